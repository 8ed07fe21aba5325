from wordfreq import count_words, top_words


def test_case_insensitive():
    assert count_words("The the THE") == {"the": 3}


def test_punctuation():
    assert count_words("Hi, there! Hi.") == {"hi": 2, "there": 1}


def test_apostrophes():
    assert count_words("don't 'tis") == {"don't": 1, "tis": 1}


def test_empty():
    assert count_words("... !!!") == {}


def test_top_words_ties():
    assert top_words("b a c b a d", 3) == [("a", 2), ("b", 2), ("c", 1)]
