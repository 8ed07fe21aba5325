"""What a cell agent drives: the proxy (drain, evacuate, activate), its inference engine
(release/resume memory), and its training seat (join/leave): ``WeightsSeat``,
``TrainerSeat`` (the core cell whose trainer follows its role), ``NoSeat``; a non-core
cell's satellite is ``services.trainer.seat.SatelliteSeat``."""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx


EVACUATE_MARGIN_S = 15.0  # the proxy's evacuation deadline ends this long before our HTTP timeout


class ProxyControl:
    """The proxy's admin endpoints. An evacuation is given an overall deadline
    (``evacuate_deadline_s``: the HTTP timeout less :data:`EVACUATE_MARGIN_S`, at least
    half of it), so the proxy stops moving sessions and answers with what it moved before
    this client gives up on it."""

    def __init__(self, url: str, admin_token: str | None, *, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                       headers={"Authorization": f"Bearer {admin_token}"} if admin_token else {})

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self._http.post(path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"proxy {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    async def add(self, cell: str, url: str, capacity: int) -> None:
        await self._post("/admin/cells", {"name": cell, "url": url, "capacity": capacity})

    @property
    def evacuate_deadline_s(self) -> float:
        return max(self.timeout_s - EVACUATE_MARGIN_S, self.timeout_s / 2)

    async def evacuate(self, cell: str, *, timeout_s: float = 30.0, migrate: bool = True) -> dict[str, Any]:
        """Drain and move the cell's sessions (drain wait ``timeout_s``); the whole of it
        within ``evacuate_deadline_s``. The answer says what moved and what was ``left``."""
        deadline = self.evacuate_deadline_s
        return await self._post(f"/admin/cells/{cell}/evacuate",
                                {"timeout_s": min(timeout_s, deadline), "migrate": migrate, "deadline_s": deadline})

    async def cells(self) -> list[dict[str, Any]]:
        r = await self._http.get("/admin/cells")
        if r.status_code >= 400:
            raise RuntimeError(f"proxy /admin/cells: {r.status_code} {r.text[:300]}")
        return r.json().get("cells", [])

    async def activate(self, cell: str) -> None:
        await self._post(f"/admin/cells/{cell}/activate", {})

    async def aclose(self) -> None:
        await self._http.aclose()


class EngineControl:
    """The cell's inference engine (embedded engine or SGLang), through SGLang's API."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def release(self) -> None:
        await self.client.release_memory(None)

    async def resume(self) -> None:
        await self.client.resume_memory(None)

    async def released(self) -> list[str]:
        """Memory the engine has released (the embedded engine says; SGLang does not: [])."""
        info = await self.client.server_info()
        states = info.get("internal_states") or [{}]
        return list(states[0].get("released") or []) if isinstance(states[0], dict) else []

    async def weight_version(self) -> int:
        info = await self.client.model_info()
        try:
            return int(info.get("weight_version", 0))
        except (TypeError, ValueError):
            return 0


class LatestWeights:
    """The newest weights the core published (``WeightsPublished`` + its safetensors blob),
    so a cell coming back to inference serves the current version, not the one it left with."""

    def __init__(self, bus: Any, blobs: Any, run_id: str) -> None:
        self.bus, self.blobs, self.run_id = bus, blobs, run_id

    async def newest(self) -> tuple[int, dict[str, Any]] | None:
        from libs.common.events import Context, decode

        raw = await self.bus.last_on_subject(Context.TRAINING, f"gyre.{self.run_id}.training.WeightsPublished")
        if raw is None:
            return None
        ev = decode(raw.data)
        if not ev.checkpoint_digest:
            return None
        data = await self.blobs.get(ev.checkpoint_digest)
        from safetensors.torch import load

        return ev.weight_version, await asyncio.to_thread(load, data)


async def push_weights(client: Any, version: int, weights: dict[str, Any]) -> None:
    """Load ``weights`` into an engine as ``version`` (SGLang's tensor update)."""
    from services.engine.weights import serialize_named_tensors

    named = [(k, v.contiguous()) for k, v in weights.items()]
    async with client.weight_update_window(str(version)):
        await client.update_weights_from_tensor(serialize_named_tensors(named), weight_version=str(version))


class TrainingSeat(Protocol):
    """The cell's place in training: a trainer replica (core or satellite)."""

    async def join(self, weight_version: int) -> None: ...

    async def leave(self) -> None: ...


@dataclass
class WeightsSeat:
    """Joins training by loading the current policy weights into a trainable model in
    this process (what a satellite must do before it can claim micro-steps); leaves by
    freeing them. The trainer service (issue 6) builds its replicas on this step."""

    model_folder: Path
    model: Any = None
    load_s: float = 0.0

    async def prepare(self) -> None:
        """At agent start (not during a switch): import the model code once, as any
        long-lived trainer process has. No weights are loaded (no memory is held)."""
        await asyncio.to_thread(self._import, self.model_folder)

    @staticmethod
    def _import(folder: Path) -> None:
        from services.engine.model_store import import_model_code

        import_model_code(folder)

    async def join(self, weight_version: int) -> None:
        start = time.monotonic()
        self.model = await asyncio.to_thread(self._load)
        self.load_s = time.monotonic() - start

    def _load(self) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.model_folder))
        model.train()
        return model

    async def leave(self) -> None:
        if self.model is None:  # not joined (a restarted agent's register): nothing to free
            return
        self.model = None
        gc.collect()


class NoSeat:
    """A cell that hosts nothing while it trains (its training replica lives elsewhere and
    does not follow the cell's switches)."""

    async def join(self, weight_version: int) -> None:
        return None

    async def leave(self) -> None:
        return None


class TrainerSeat:
    """The core cell whose trainer service follows its role (``cells.core_follows_role``,
    ``GYRE_TRAINER_FOLLOW_ROLE``): ``join`` asks the trainer to start claiming, ``leave``
    to stop, answered once its micro-step in hand is done, so the engine takes its memory
    back only after that (``services/trainer/gate.py``). The leave's wait is bounded below
    the scheduler's 300 s switch request timeout; a leave that times out is rolled back by
    joining again (``CellAgent._roll_back``)."""

    def __init__(self, bus, run_id: str, cell: str, *, join_timeout_s: float = 60.0,
                 leave_timeout_s: float = 240.0, tries: int = 20) -> None:
        self.bus, self.run_id, self.cell = bus, run_id, cell
        self.join_timeout_s, self.leave_timeout_s, self.tries = join_timeout_s, leave_timeout_s, tries

    async def _ask(self, op: str, timeout_s: float) -> None:
        from nats.errors import NoRespondersError

        from services.trainer.gate import request

        for attempt in range(self.tries):  # the trainer may be subscribing still (it starts beside the cell)
            try:
                await request(self.bus.nc, self.run_id, self.cell, op, timeout_s=timeout_s)
                return
            except NoRespondersError:
                if attempt == self.tries - 1:
                    raise RuntimeError(f"no core trainer answers for cell {self.cell} "
                                       "(is it running with GYRE_TRAINER_FOLLOW_ROLE=1?)") from None
                await asyncio.sleep(0.5)

    async def join(self, weight_version: int) -> None:
        await self._ask("join", self.join_timeout_s)

    async def leave(self) -> None:
        await self._ask("leave", self.leave_timeout_s)
