"""Hidden tests of starter_fold_sub5: `fold(x)` returns `x - 5`."""

from solution import fold


def test_defined():
    assert callable(fold)


def test_returns_int():
    assert isinstance(fold(4), int)


def test_operation():
    assert fold(9) - fold(4) == 5


def test_small():
    assert fold(2) == -3


def test_values():
    assert [fold(x) for x in (-3, 0, 11)] == [-8, -5, 6]
