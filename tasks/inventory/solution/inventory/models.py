from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0

    def __post_init__(self) -> None:
        if not self.sku or self.price < 0 or self.quantity < 0:
            raise ValueError("invalid item")
