from slug import slugify


def test_simple():
    assert slugify("Hello World") == "hello-world"


def test_punctuation_runs():
    assert slugify("  Hello,   World!!  ") == "hello-world"


def test_custom_sep():
    assert slugify("a b c", sep="_") == "a_b_c"


def test_accents():
    assert slugify("Café déjà vu") == "cafe-deja-vu"


def test_digits_kept():
    assert slugify("Top 10 Tips") == "top-10-tips"


def test_empty():
    assert slugify("!!!") == ""
