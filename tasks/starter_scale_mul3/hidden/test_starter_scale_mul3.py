"""Hidden tests of starter_scale_mul3: `scale(x)` returns `x * 3`."""

from solution import scale


def test_defined():
    assert callable(scale)


def test_returns_int():
    assert isinstance(scale(4), int)


def test_operation():
    assert scale(0) == 0 and scale(6) == 2 * scale(3)


def test_small():
    assert scale(2) == 6


def test_values():
    assert [scale(x) for x in (-3, 0, 11)] == [-9, 0, 33]
