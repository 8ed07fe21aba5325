"""Hidden tests of starter_scale_add2: `scale(x)` returns `x + 2`."""

from solution import scale


def test_defined():
    assert callable(scale)


def test_returns_int():
    assert isinstance(scale(4), int)


def test_operation():
    assert scale(9) - scale(4) == 5


def test_small():
    assert scale(2) == 4


def test_values():
    assert [scale(x) for x in (-3, 0, 11)] == [-1, 2, 13]
