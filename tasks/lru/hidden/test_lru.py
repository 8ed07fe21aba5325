import pytest

from lru import LRUCache


def test_put_get():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1 and c.get("b", 0) == 0


def test_eviction():
    c = LRUCache(2)
    c.put("a", 1); c.put("b", 2); c.put("c", 3)
    assert "a" not in c and len(c) == 2


def test_get_refreshes():
    c = LRUCache(2)
    c.put("a", 1); c.put("b", 2); c.get("a"); c.put("c", 3)
    assert "a" in c and "b" not in c


def test_update_refreshes():
    c = LRUCache(2)
    c.put("a", 1); c.put("b", 2); c.put("a", 10); c.put("c", 3)
    assert c.get("a") == 10 and "b" not in c


def test_keys_order_and_contains_does_not_touch():
    c = LRUCache(3)
    c.put(1, "x"); c.put(2, "y"); c.put(3, "z")
    assert 1 in c
    assert c.keys() == [1, 2, 3]


def test_bad_capacity():
    with pytest.raises(ValueError):
        LRUCache(0)
