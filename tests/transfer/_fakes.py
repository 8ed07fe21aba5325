"""Test doubles for the migration orchestration's edge: the cells it talks to over HTTP.

``ScriptedCell`` stands in for a remote inference cell (``KVCell``): each method either
answers what the test scripted or raises the scripted error, and every call is logged.
It fakes only the network answer; the real engines and transfer libraries are exercised
in ``scenarios.py`` (``test_migration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScriptedCell:
    name: str
    offer: dict[str, Any] | Exception | None = None
    fetch: dict[str, Any] | Exception | None = None
    export: bytes | Exception | None = None
    import_: dict[str, Any] | Exception | None = None
    calls: list[str] = field(default_factory=list)

    def _answer(self, what: str, value):
        self.calls.append(what)
        if isinstance(value, Exception):
            raise value
        if value is None:
            raise AssertionError(f"{self.name}: {what} was not expected")
        return value

    async def kv_offer(self, input_ids, *, checksums=False):
        return self._answer("offer", self.offer)

    async def kv_fetch(self, offer, *, verify=None, timeout_s=60.0):
        return self._answer("fetch", self.fetch)

    async def kv_release(self, lease):
        self.calls.append("release")

    async def kv_export(self, input_ids):
        return self._answer("export", self.export)

    async def kv_import(self, blob):
        return self._answer("import", self.import_)
