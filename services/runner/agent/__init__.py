"""``gyre agent``: the reference agent harness (see ``main``)."""

from .main import main

__all__ = ["main"]
