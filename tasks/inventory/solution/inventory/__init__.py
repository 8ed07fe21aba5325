from .models import Item
from .store import Inventory

__all__ = ["Inventory", "Item"]
