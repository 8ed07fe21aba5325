"""Hidden tests of starter_shift_mul3: `shift(x)` returns `x * 3`."""

from solution import shift


def test_defined():
    assert callable(shift)


def test_returns_int():
    assert isinstance(shift(4), int)


def test_operation():
    assert shift(0) == 0 and shift(6) == 2 * shift(3)


def test_small():
    assert shift(2) == 6


def test_values():
    assert [shift(x) for x in (-3, 0, 11)] == [-9, 0, 33]
