"""Hidden tests of starter_spin_add2: `spin(x)` returns `x + 2`."""

from solution import spin


def test_defined():
    assert callable(spin)


def test_returns_int():
    assert isinstance(spin(4), int)


def test_operation():
    assert spin(9) - spin(4) == 5


def test_small():
    assert spin(2) == 4


def test_values():
    assert [spin(x) for x in (-3, 0, 11)] == [-1, 2, 13]
