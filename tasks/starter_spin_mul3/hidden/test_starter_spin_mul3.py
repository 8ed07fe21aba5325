"""Hidden tests of starter_spin_mul3: `spin(x)` returns `x * 3`."""

from solution import spin


def test_defined():
    assert callable(spin)


def test_returns_int():
    assert isinstance(spin(4), int)


def test_operation():
    assert spin(0) == 0 and spin(6) == 2 * spin(3)


def test_small():
    assert spin(2) == 6


def test_values():
    assert [spin(x) for x in (-3, 0, 11)] == [-9, 0, 33]
