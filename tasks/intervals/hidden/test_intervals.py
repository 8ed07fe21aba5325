import pytest

from intervals import merge, overlaps, total_length


def test_merge_overlapping():
    assert merge([(6, 8), (1, 3), (2, 4)]) == [(1, 4), (6, 8)]


def test_merge_touching():
    assert merge([(1, 2), (3, 4)]) == [(1, 4)]


def test_merge_disjoint_sorted():
    assert merge([(10, 12), (1, 2)]) == [(1, 2), (10, 12)]


def test_input_not_modified():
    data = [(3, 4), (1, 2)]
    merge(data)
    assert data == [(3, 4), (1, 2)]


def test_total_length():
    assert total_length([(1, 3), (2, 5), (10, 10)]) == 6


def test_overlaps():
    assert overlaps((1, 5), (5, 9)) and not overlaps((1, 4), (5, 9))


def test_bad_interval():
    with pytest.raises(ValueError):
        merge([(3, 1)])
    with pytest.raises(ValueError):
        overlaps((2, 1), (0, 5))
