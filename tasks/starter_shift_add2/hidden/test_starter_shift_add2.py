"""Hidden tests of starter_shift_add2: `shift(x)` returns `x + 2`."""

from solution import shift


def test_defined():
    assert callable(shift)


def test_returns_int():
    assert isinstance(shift(4), int)


def test_operation():
    assert shift(9) - shift(4) == 5


def test_small():
    assert shift(2) == 4


def test_values():
    assert [shift(x) for x in (-3, 0, 11)] == [-1, 2, 13]
