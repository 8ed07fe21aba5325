import pytest

from matrix import add, identity, multiply, shape, transpose


def test_identity():
    assert identity(2) == [[1, 0], [0, 1]]


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_add():
    assert add([[1, 2]], [[3, 4]]) == [[4, 6]]


def test_multiply():
    assert multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]


def test_multiply_identity():
    m = [[2, 3], [4, 5]]
    assert multiply(m, identity(2)) == m


def test_shape_and_errors():
    assert shape([[1, 2, 3]]) == (1, 3)
    with pytest.raises(ValueError):
        shape([[1, 2], [3]])
    with pytest.raises(ValueError):
        multiply([[1, 2]], [[1, 2]])
