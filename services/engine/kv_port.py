"""KV migration through the transfer port (Mooncake / UCX), beside the HTTP blob path.

Routes (admin token like the other control endpoints):

- ``POST /gyre/kv/port/offer {"input_ids", "checksums"?}``: exports the cached prefix of
  ``input_ids`` into registered memory and answers its transfer descriptor (JSON;
  ``meta.token_ids`` are the matched ids, empty when nothing is cached).
- ``POST /gyre/kv/port/fetch {"offer", "verify"?, "timeout_s"?}``: pulls an offer from
  another cell and, once every block arrived (and verified), imports it into this cell's
  prefix cache; refuses KV of another weight version or shape before moving a byte.
- ``POST /gyre/kv/port/release {"lease"}``: the source drops an offer.

An offer pins its KV (registered with the transfer agent) until it is released or, when the
release never comes (a scheduler that died between offer and release, a lost request), until
its time to live passes (``offer_ttl_s``, default ``OFFER_TTL_S``): each offer arms a timer on
the serving event loop that drops it then, so its memory is freed on time whether or not
another offer follows (a sweep on every offer also catches one whose loop has gone). The
offer's ``meta`` says when it expires (``expires_at``, wall clock, and ``ttl_s``); a fetch
of an expired offer is refused before a byte moves, and one whose offer expired while it
was read imports nothing (the source may have freed those blocks mid-read): both answer a
400 naming the expired lease (wall clocks of the two cells are assumed to agree to well
within the TTL).

The agent is this process's embedded default (``libs.common.transfer.default``), opened
on first use; when no backend opens (or the transfer fails), offer, fetch and release answer
a 400 naming the backend problem, not a bare 500. ``http_app.create_app`` serves these routes (with ``kv_offer_ttl_s``);
``attach(service)`` returns that port, or adds the routes to a service built without them.
:class:`PortCellClient` is the scheduler's handle on a cell for
``libs.common.transfer.kv.migrate_session``; :class:`PortKvMover` plugs the same path into
the proxy's ``evacuate`` (``service.kv_mover``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request

from libs.common.transfer.kv import MigrationResult, fetch_kv, migrate_session, offer_kv, release_kv
from libs.common.transfer.port import PeerDescriptor, TransferAgent, TransferFailed

from .client import CellError, EngineClient
from .engine import MemoryReleased
from .engine import Engine
from .http_body import json_body
from .kv_transfer import import_answer
from .params import InvalidRequest

log = logging.getLogger(__name__)

OFFER_TTL_S = 300.0


class OfferExpired(InvalidRequest):
    """A fetch of an offer whose time to live has passed: its KV is (or may be) freed."""


class KVPort:
    """One engine's side of port migration: its agent and its open offers."""

    def __init__(self, engine: Engine, agent: TransferAgent | None = None, *,
                 offer_ttl_s: float = OFFER_TTL_S) -> None:
        if not offer_ttl_s > 0:
            raise ValueError(f"offer_ttl_s must be positive, not {offer_ttl_s!r}")
        self.engine = engine
        self.offer_ttl_s = float(offer_ttl_s)
        self._agent = agent
        # lease -> (expiry on time.monotonic(), the timer that drops it then, or None)
        self._offers: dict[str, tuple[float, asyncio.TimerHandle | None]] = {}
        self._lock = threading.Lock()

    def use_agent(self, agent: TransferAgent) -> None:
        """Use this agent (before the first migration opens the default one)."""
        with self._lock:
            self._agent = agent

    @property
    def agent(self) -> TransferAgent:
        with self._lock:
            if self._agent is None:
                from libs.common.transfer.weights import default_agent

                self._agent = default_agent()
            return self._agent

    async def offer(self, input_ids: list[int], checksums: bool = False) -> dict[str, Any]:
        self._expire()
        engine = self.engine
        # the version is read in the same engine-thread command as the KV: an update landing
        # between the two would otherwise label old KV with the new version
        # (handed back through a box emptied here, not as the command's result: the engine
        # thread keeps its last command, result included, until the next one comes, which
        # would keep the KV alive after the offer is released or expired)
        box: list = []

        def export() -> None:
            engine.check_weight_label("KV offer")  # its label would vouch for weights it does not name
            box.append((*engine.prefix_cache.export(input_ids), engine.weight_version))

        await engine.acall(export)
        matched, kv, version = box.pop()
        if matched == 0:
            return PeerDescriptor(self.agent.backend, self.agent.endpoint,
                                  meta={"kind": "kv", "lease": None, "token_ids": []}).to_json()
        desc = await asyncio.to_thread(offer_kv, self.agent, kv, input_ids[:matched],
                                       weight_version=version, checksums=checksums)
        lease, ttl = desc.meta["lease"], self.offer_ttl_s
        deadline = time.monotonic() + ttl
        # armed after the deadline is taken, so it never fires before it
        timer = asyncio.get_running_loop().call_later(ttl, self._timed_out, lease)
        with self._lock:
            self._offers[lease] = (deadline, timer)
        out = desc.to_json()
        out["meta"].update(ttl_s=ttl, expires_at=time.time() + ttl)
        return out

    @property
    def open_leases(self) -> list[str]:
        """The offers not yet released or expired (their KV is pinned)."""
        with self._lock:
            return list(self._offers)

    async def fetch(self, offer: dict[str, Any], verify: bool | None = None, timeout_s: float = 60.0) -> dict:
        peer = PeerDescriptor.from_json(offer)
        ids = [int(t) for t in peer.meta.get("token_ids", [])]
        if not ids:
            return {"success": True, "added_tokens": 0, "tokens": 0, "bytes": 0, "backend": peer.backend}
        generation = self.engine.weight_generation  # any write after this makes the fetched KV stale
        self._check(peer)
        started = time.perf_counter()
        try:
            ids, kv = await asyncio.to_thread(fetch_kv, self.agent, peer, verify=verify, timeout_s=timeout_s)
        except Exception as exc:
            if _expired(peer):  # the likely cause: the source dropped the blocks
                raise OfferExpired(f"{_expiry_text(peer)} while it was read ({type(exc).__name__}: {exc}); "
                                   "nothing imported") from None
            raise
        if _expired(peer):  # the source may have freed (and reused) the blocks mid-read
            raise OfferExpired(f"{_expiry_text(peer)} while it was read; nothing imported")
        moved = time.perf_counter() - started
        engine = self.engine

        def apply() -> dict:
            if "kv_cache" in engine.released:  # the cell went to training meanwhile
                raise MemoryReleased("the KV cache's memory is released; resume it before importing a prefix")
            # an update landed meanwhile (one without weight_version keeps the label: hence the counter)
            if engine.weight_version != peer.meta.get("weight_version") or engine.weight_generation != generation:
                raise InvalidRequest("weights changed during the transfer; KV not imported")
            try:
                added = engine.prefix_cache.import_(ids, kv)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            return import_answer(engine, ids, added)  # what the cache kept, not what arrived

        answer = await engine.acall(apply)
        return {**answer, "bytes": kv.numel() * 4, "backend": peer.backend, "transfer_s": moved}

    def release(self, lease: str) -> bool:
        """Drops an open offer of this port; False for any other name. The agent also holds
        regions that are not offers (published weight snapshots, staging buffers): a release
        must never reach those."""
        agent = self.agent  # first: a cell whose backend does not open says so, not "no such offer"
        with self._lock:
            entry = self._offers.pop(lease, None)
        if entry is not None and entry[1] is not None:
            entry[1].cancel()
        self._expire()
        return entry is not None and release_kv(agent, lease)

    def close(self) -> None:
        """Drops every open offer (the service is stopping)."""
        with self._lock:
            leases = list(self._offers)
        for lease in leases:
            self.release(lease)

    def _timed_out(self, lease: str) -> None:
        """The offer's timer (on the serving loop): drops it unless released meanwhile."""
        with self._lock:
            if self._offers.pop(lease, None) is None:
                return
        try:
            dropped = release_kv(self.agent, lease)
        except Exception as exc:  # a timer callback must not raise into the loop
            log.warning("kv port: dropping expired offer %s failed: %r", lease, exc)
            return
        if dropped:
            log.info("kv port: offer %s expired after %g s without a release; its KV is freed",
                     lease, self.offer_ttl_s)

    def _check(self, peer: PeerDescriptor) -> None:
        meta, engine = peer.meta, self.engine
        if _expired(peer):  # before anything else: nothing to move
            raise OfferExpired(f"{_expiry_text(peer)}; its KV is no longer held, nothing imported "
                               "(ask the source for a new offer)")
        if "kv_cache" in engine.released:  # as the HTTP import: a cell lent to training takes no KV
            raise MemoryReleased("the KV cache's memory is released; resume it before importing a prefix")
        if peer.backend != self.agent.backend:
            raise InvalidRequest(f"offer is on {peer.backend}, this cell's transfer agent is {self.agent.backend}")
        if meta.get("weight_version") != engine.weight_version:
            raise InvalidRequest(f"KV is from weight version {meta.get('weight_version')!r}, "
                                 f"this cell runs {engine.weight_version!r}")
        engine.check_weight_label("KV import")  # the label matched, but this cell's weights may not be that version
        s = engine.runner.shape
        expected = [s.layers, 2, s.kv_heads, len(meta["token_ids"]), s.head_dim]
        if list(meta.get("shape", [])) != expected or meta.get("dtype") != "float32":
            raise InvalidRequest(f"KV must be float32 {expected}, offer is {meta.get('dtype')} {meta.get('shape')}")

    def _expire(self) -> None:
        """Drops offers past their deadline whose timer did not (its loop is gone)."""
        now = time.monotonic()
        with self._lock:
            stale = [lease for lease, (until, _) in self._offers.items() if until < now]
        for lease in stale:
            self._timed_out(lease)


def _expired(peer: PeerDescriptor) -> bool:
    """Whether the offer's ``expires_at`` (the source's wall clock) has passed."""
    expires_at = peer.meta.get("expires_at")
    try:
        return expires_at is not None and time.time() >= float(expires_at)
    except (TypeError, ValueError):
        return False


def _expiry_text(peer: PeerDescriptor) -> str:
    meta = peer.meta
    ago = time.time() - float(meta["expires_at"])
    ttl = meta.get("ttl_s")
    kept = f" (offers are kept {ttl:g} s)" if isinstance(ttl, (int, float)) else ""
    return f"KV offer {meta.get('lease')!r} expired {ago:.1f} s ago{kept}"


def add_routes(app: FastAPI, port: KVPort, admin) -> None:
    @app.post("/gyre/kv/port/offer", dependencies=[admin])
    async def kv_port_offer(request: Request) -> dict:
        body = await json_body(request)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("input_ids must be a list of token ids")
        try:
            return await port.offer(ids, bool(body.get("checksums", False)))
        except TransferFailed as exc:  # e.g. no transfer backend opens here: a clear 400, not a bare 500
            raise InvalidRequest(f"kv offer failed, nothing offered: {exc}") from None

    @app.post("/gyre/kv/port/fetch", dependencies=[admin])
    async def kv_port_fetch(request: Request) -> dict:
        body = await json_body(request)
        if not isinstance(body.get("offer"), dict):
            raise InvalidRequest("offer must be a transfer descriptor")
        try:
            return await port.fetch(body["offer"], body.get("verify"), float(body.get("timeout_s", 60.0)))
        except InvalidRequest:
            raise
        except Exception as exc:  # TransferFailed, ChecksumMismatch, timeouts: nothing was imported
            raise InvalidRequest(f"kv transfer failed, nothing imported: {type(exc).__name__}: {exc}") from None

    @app.post("/gyre/kv/port/release", dependencies=[admin])
    async def kv_port_release(request: Request) -> dict:
        lease = (await json_body(request)).get("lease")
        if not isinstance(lease, str):
            raise InvalidRequest("lease must be a string")
        try:
            if port.release(lease):
                return {"success": True}
            return {"success": False, "message": f"no open KV offer {lease!r} on this cell (released, expired, "
                                                 "or not an offer of this port); nothing dropped"}
        except TransferFailed as exc:  # the transfer backend cannot open (or drop the region)
            raise InvalidRequest(f"kv release failed: {exc}") from None


def attach(service, agent: TransferAgent | None = None) -> KVPort:
    """The service's KV port: the one ``create_app`` made (using ``agent`` if given), or
    new routes on a service built without them; both routes share one transfer agent."""
    from . import http_app, weights_port

    existing = getattr(service.app.state, "kv_port", None)
    if existing is not None:  # create_app already serves the port routes
        if agent is not None:
            existing.use_agent(agent)
        service.kv_port = existing
        return existing
    guard = getattr(http_app, "admin_guard", None) or http_app._admin_guard
    port = KVPort(service.engine, agent,
                  offer_ttl_s=getattr(service.settings, "kv_offer_ttl_s", None) or OFFER_TTL_S)
    admin = Depends(guard(service.settings))
    add_routes(service.app, port, admin)
    weights_port.add_routes(service.app, service.weights, lambda: port.agent, admin)
    service.kv_port = port
    return port


class PortCellClient:
    """One cell as ``migrate_session`` sees it: port routes plus the HTTP export/import fallback."""

    def __init__(self, name: str, base_url: str = "", *, admin_token: str | None = None, timeout: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None, engine: EngineClient | None = None) -> None:
        self.name = name
        self._owned = engine is None
        self.engine = engine or EngineClient(base_url, admin_token=admin_token, timeout=timeout, transport=transport)
        # The engine client's own connection (base URL, admin token): see the report's note on
        # EngineClient growing kv_offer / kv_fetch / kv_release so this reaches no private field.
        self._http: httpx.AsyncClient = self.engine._http

    @classmethod
    def wrap(cls, name: str, engine: EngineClient) -> "PortCellClient":
        """A view of an existing client (the proxy's ``service.clients[cell]``); closing it is the owner's job."""
        return cls(name, engine=engine)

    async def aclose(self) -> None:
        if self._owned:
            await self.engine.aclose()

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None) -> dict:
        return await self.engine.generate(input_ids, sampling_params)

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def kv_offer(self, input_ids: list[int], *, checksums: bool = False) -> dict[str, Any]:
        return await self._post("/gyre/kv/port/offer", {"input_ids": input_ids, "checksums": checksums})

    async def kv_fetch(self, offer: dict[str, Any], *, verify: bool | None = None, timeout_s: float = 60.0) -> dict:
        answer = await self._post("/gyre/kv/port/fetch", {"offer": offer, "verify": verify, "timeout_s": timeout_s})
        if answer.get("success") is False:  # moved but not kept: migrate_session must not count it
            raise CellError(200, answer.get("message") or "the target kept none of the KV")
        return answer

    async def kv_release(self, lease: str) -> None:
        await self._post("/gyre/kv/port/release", {"lease": lease})

    async def kv_export(self, input_ids: list[int]) -> bytes:
        return await self.engine.kv_export(input_ids)

    async def kv_import(self, blob: bytes) -> dict:
        return await self.engine.kv_import(blob)

    async def _post(self, path: str, body: dict) -> Any:
        response = await self._http.post(path, json=body)
        if response.status_code >= 400:
            raise CellError(response.status_code, response.text)
        return response.json()


class PortKvMover:
    """The proxy's ``KvMover`` (``services/proxy/migration.evacuate``) over the transfer port:
    port first, the engines' HTTP export/import as fallback; raises when neither worked, so
    the proxy records a re-prefill (it publishes ``SessionRerouted`` itself)."""

    def __init__(self, *, verify: bool | None = None, timeout_s: float = 60.0) -> None:
        self.verify, self.timeout_s = verify, timeout_s
        self.last: MigrationResult | None = None  # which path the newest move took, for logs and tests

    async def move(self, source: EngineClient, target: EngineClient, input_ids: list[int]) -> int:
        result = await migrate_session(PortCellClient.wrap("source", source), PortCellClient.wrap("target", target),
                                       input_ids, session_id="evacuation", verify=self.verify,
                                       timeout_s=self.timeout_s)
        self.last = result
        if result.kv != "migrated":
            raise TransferFailed("; ".join(result.errors) or "nothing migrated")
        return result.migrated_tokens
