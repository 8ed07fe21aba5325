from dataclasses import replace

from .models import Item


class Inventory:
    def __init__(self) -> None:
        self._items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        old = self._items.get(item.sku)
        self._items[item.sku] = item if old is None else replace(old, quantity=old.quantity + item.quantity)

    def remove(self, sku: str, quantity: int) -> None:
        old = self._items[sku]
        if quantity > old.quantity:
            raise ValueError("not enough stock")
        self._items[sku] = replace(old, quantity=old.quantity - quantity)

    def get(self, sku: str):
        return self._items.get(sku)

    def total_value(self) -> float:
        return sum(i.price * i.quantity for i in self._items.values())

    def low_stock(self, threshold: int) -> list[str]:
        return sorted(s for s, i in self._items.items() if i.quantity < threshold)
