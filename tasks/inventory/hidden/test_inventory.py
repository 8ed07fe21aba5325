import dataclasses

import pytest

from inventory import Inventory, Item


def test_item_frozen_and_valid():
    item = Item("a1", "bolt", 0.5, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.quantity = 3
    for bad in (("", "x", 1.0), ("a", "x", -1.0), ("a", "x", 1.0, -2)):
        with pytest.raises(ValueError):
            Item(*bad)


def test_add_and_merge():
    inv = Inventory()
    inv.add(Item("a1", "bolt", 0.5, 10))
    inv.add(Item("a1", "bolt", 0.5, 5))
    assert inv.get("a1").quantity == 15 and inv.get("zz") is None


def test_remove():
    inv = Inventory()
    inv.add(Item("a1", "bolt", 0.5, 10))
    inv.remove("a1", 4)
    assert inv.get("a1").quantity == 6
    with pytest.raises(ValueError):
        inv.remove("a1", 7)
    with pytest.raises(KeyError):
        inv.remove("nope", 1)


def test_total_value():
    inv = Inventory()
    inv.add(Item("a", "x", 2.0, 3))
    inv.add(Item("b", "y", 0.5, 4))
    assert inv.total_value() == pytest.approx(8.0)


def test_low_stock():
    inv = Inventory()
    for sku, q in (("c", 1), ("a", 0), ("b", 9)):
        inv.add(Item(sku, sku, 1.0, q))
    assert inv.low_stock(2) == ["a", "c"]
