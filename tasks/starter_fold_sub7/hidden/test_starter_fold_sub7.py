"""Hidden tests of starter_fold_sub7: `fold(x)` returns `x - 7`."""

from solution import fold


def test_defined():
    assert callable(fold)


def test_returns_int():
    assert isinstance(fold(4), int)


def test_operation():
    assert fold(9) - fold(4) == 5


def test_small():
    assert fold(2) == -5


def test_values():
    assert [fold(x) for x in (-3, 0, 11)] == [-10, -7, 4]
