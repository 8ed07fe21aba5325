import pytest

from roman import from_roman, to_roman


def test_small():
    assert [to_roman(i) for i in (1, 4, 9, 14, 40)] == ["I", "IV", "IX", "XIV", "XL"]


def test_large():
    assert to_roman(1994) == "MCMXCIV" and to_roman(3999) == "MMMCMXCIX"


def test_parse():
    assert from_roman("MCMXCIV") == 1994 and from_roman("XLII") == 42


def test_round_trip():
    assert all(from_roman(to_roman(i)) == i for i in range(1, 4000))


def test_range_errors():
    for bad in (0, -1, 4000):
        with pytest.raises(ValueError):
            to_roman(bad)


def test_parse_errors():
    for bad in ("", "IIII", "ABC", "IC"):
        with pytest.raises(ValueError):
            from_roman(bad)
