"""Hidden tests of starter_fold_mul7: `fold(x)` returns `x * 7`."""

from solution import fold


def test_defined():
    assert callable(fold)


def test_returns_int():
    assert isinstance(fold(4), int)


def test_operation():
    assert fold(0) == 0 and fold(6) == 2 * fold(3)


def test_small():
    assert fold(2) == 14


def test_values():
    assert [fold(x) for x in (-3, 0, 11)] == [-21, 0, 77]
