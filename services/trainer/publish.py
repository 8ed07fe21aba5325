"""Weight publication to inference cells through :class:`EngineClient` (SGLang's API).

``tensor``: ``/update_weights_from_tensor`` inside a ``begin/end_weight_update`` window
(all or nothing, the version recorded at ``end``); the tensors travel through shared
memory, so this is for cells on the same machine. ``disk``: the weights are written as
an HF folder (safetensors + the model's ``config.json``) and each cell loads it with
``/update_weights_from_disk``; only the newest ``keep`` version folders stay (None: all;
a cell has loaded a folder when its update call returns). Running rollouts go on: the engine applies an update
between forward steps and every output token keeps the version that produced it.

Generation during an update: with ``pause="none"`` (the default) the engine's own
``weight_update_mode`` decides (the embedded engine's ``wait`` holds new requests until the
running ones finish; SGLang applies between steps). An engine in ``reject`` mode refuses an
update while it generates; the publisher then pauses it in place, sends the update again and
continues generation (the running requests keep their KV and go on under the new version,
each token tagged with the version that produced it). ``pause="in_place"`` does that for
every update (SGLang's pause / update / continue flow).

``distributed``: the core hosts a gloo broadcast group (rank 0; each cell joins with
``/init_weights_update_group``) and broadcasts every tensor while each cell receives it
through ``/update_weights_from_distributed`` (SGLang's rendezvous,
:func:`services.engine.weights.join_weight_group`; NCCL on GPU clusters is the same call
with ``backend="nccl"``, not exercised here). A gloo group needs every member, so before
each publication the core asks every cell's ``/health`` (bounded by ``probe_timeout_s``)
and the group holds the cells that answer: a cell that is down is left out and the others
get the version. When the answering cells differ from the group's members (one went down,
one came back) the group is closed and a new one opened with them; a cell that missed
versions gets the newest whole model when it joins again (every broadcast carries the whole
model; a cell that restarts loads the newest ``WeightsPublished`` blob itself). When a cell
that answers cannot join (503, timeout) the publisher stops the rendezvous store at once
(so the cells still waiting and its own rank fail within moments, and the port is free),
tells the cells to leave the group, logs which cell failed first and why, sets that cell
aside for ``rejoin_after_s`` and opens the group once more without it, in the same
publication. A broadcast that fails is torn down the same way (the cells whose receive
failed are set aside). A version that reaches no cell returns ``[]``; the core goes on and
records ``WeightsPublished`` with no target cells. Joining and each collective are bounded
by ``join_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)


def _refused_while_generating(exc: BaseException) -> bool:
    """The engine's ``weight_update_mode=reject`` refused: requests were running, not paused."""
    return getattr(exc, "status", None) == 400 and "weight update refused" in str(getattr(exc, "message", ""))


def _released(exc: BaseException) -> bool:
    """The engine refused because its memory is released (SGLang's ``release_memory_occupation``)."""
    return getattr(exc, "status", None) == 400 and "weights are released" in str(getattr(exc, "message", ""))


@dataclass
class EnginePublisher:
    clients: dict[str, object]  # cell -> services.engine.client.EngineClient
    mode: Literal["tensor", "disk", "distributed"] = "tensor"
    folder: Path | None = None  # disk mode: where versions are written
    hf_config: Path | None = None  # disk mode: the model's config.json
    master_address: str = "127.0.0.1"  # distributed mode: where the core hosts the group
    master_port: int = 0  # 0: a free port
    group_name: str = "gyre-weights"
    pause: Literal["none", "in_place"] = "none"  # tensor / disk: pause generation around every update
    keep: int | None = None  # disk mode: newest version folders kept (None: all); see the trainer's keep_weights
    join_timeout_s: float = 120.0  # distributed mode: the rendezvous and every collective
    probe_timeout_s: float = 5.0  # distributed mode: a cell's /health before each publication
    rejoin_after_s: float = 60.0  # distributed mode: a cell that failed to join is left out this long
    _group: object = field(default=None, repr=False)
    _store: object = field(default=None, repr=False)
    _members: tuple[str, ...] = field(default=(), repr=False)  # the cells in the open group, in rank order
    _benched: dict[str, float] = field(default_factory=dict, repr=False)  # cell -> monotonic time it may rejoin

    async def __call__(self, version: int, weights: dict[str, torch.Tensor]) -> list[str]:
        if self.mode == "distributed":
            return await self._broadcast(version, weights)
        done = []
        path = self._write(version, weights) if self.mode == "disk" else None
        for cell, client in self.clients.items():
            try:
                await self._send(client, version, weights, path)
            except Exception as exc:  # one cell failing must not stop the others or the core
                if _released(exc):  # a cell lent to training: it loads the newest version when it resumes
                    log.info("v%d not sent to %s: its weights are released (the cell trains)", version, cell)
                else:
                    log.warning("publishing v%d to %s failed: %r", version, cell, exc)
                continue
            done.append(cell)
        if path is not None and self.keep is not None:
            self._prune(path)
        return done

    def _prune(self, latest: Path) -> None:
        """Deletes all but the newest ``keep`` ``v*`` folders (by version), never ``latest``."""
        def version_of(p: Path) -> int:
            try:
                return int(p.name[1:]) if p.name.startswith("v") and p.is_dir() else -1
            except ValueError:
                return -1
        found = sorted((p for p in self.folder.iterdir() if version_of(p) >= 0), key=version_of, reverse=True)
        for old in found[self.keep:]:
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)

    async def _send(self, client, version: int, weights: dict[str, torch.Tensor], path: Path | None) -> None:
        if self.pause == "in_place":
            await self._paused(client, version, weights, path)
            return
        try:
            await self._update(client, version, weights, path)
        except Exception as exc:
            if not _refused_while_generating(exc):
                raise
            log.info("v%d refused while the engine generates: pausing it in place for the update", version)
            await self._paused(client, version, weights, path)

    async def _paused(self, client, version: int, weights: dict[str, torch.Tensor], path: Path | None) -> None:
        await client.pause("in_place")
        try:
            await self._update(client, version, weights, path)
        finally:
            await client.resume_generation()

    async def _update(self, client, version: int, weights: dict[str, torch.Tensor], path: Path | None) -> None:
        tag = str(version)
        if path is not None:
            await client.update_weights_from_disk(str(path), weight_version=tag)
            return
        from services.engine.weights import serialize_named_tensors

        named = [(k, v.detach().contiguous()) for k, v in weights.items()]
        async with client.weight_update_window(tag):
            await client.update_weights_from_tensor(serialize_named_tensors(named), weight_version=tag)

    def _write(self, version: int, weights: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        if self.folder is None or self.hf_config is None:
            raise ValueError("disk publication needs a folder and the model's config.json")
        target = self.folder / f"v{version:06d}"
        target.mkdir(parents=True, exist_ok=True)
        seen, state = set(), {}
        for k, v in weights.items():  # tied tensors: write each storage once
            if v.data_ptr() in seen and k == "lm_head.weight":
                continue
            seen.add(v.data_ptr())
            state[k] = v.detach().contiguous().cpu()
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(self.hf_config, target / "config.json")
        (target / "gyre_weights.json").write_text(json.dumps({"weight_version": version}) + "\n")
        return target

    async def _reachable(self) -> tuple[str, ...]:
        """The cells that answer ``/health`` now and are not set aside, in configured order."""
        now = time.monotonic()
        self._benched = {cell: until for cell, until in self._benched.items() if until > now}
        asked = [cell for cell in self.clients if cell not in self._benched]

        async def probe(cell: str) -> bool:
            try:
                return bool(await asyncio.wait_for(self.clients[cell].health(), self.probe_timeout_s))
            except Exception:  # a timeout or a client that cannot connect: not reachable
                return False

        answers = await asyncio.gather(*(probe(cell) for cell in asked))
        return tuple(cell for cell, ok in zip(asked, answers) if ok)

    def _bench(self, cells, why: str) -> None:
        until = time.monotonic() + self.rejoin_after_s
        for cell in cells:
            self._benched[cell] = until
            log.warning("%s is left out of the weight broadcast group for %.0f s: %s", cell, self.rejoin_after_s, why)

    async def _ensure_group(self, version: int) -> bool:
        """Opens (or re-forms) the group with the cells that answer; False: no group."""
        members = await self._reachable()
        if self._group is not None and members == self._members:
            return True
        if self._group is not None:
            log.info("v%d: the weight group changes from %s to %s", version, list(self._members), list(members))
            await self.close()
        skipped = [cell for cell in self.clients if cell not in members]
        if skipped:
            log.warning("v%d is not broadcast to %s: not answering /health or set aside after a failed join",
                        version, ", ".join(skipped))
        for attempt in range(2):  # the second without the cell that failed first
            if not members:
                log.error("v%d published to no cell: no cell can join the broadcast group", version)
                return False
            failed = await self._open_group(members)
            if not failed:
                return True
            cause = next(iter(failed))
            log.error("v%d: the broadcast group of %s could not open (first failure first: %s)", version,
                      list(members), "; ".join(f"{cell}: {exc!r}" for cell, exc in failed.items()))
            if cause in self.clients:
                self._bench([cause], f"its join failed: {failed[cause]!r}")
            if cause not in self.clients or attempt:
                log.error("v%d published to no cell: the broadcast group could not open", version)
                return False
            members = tuple(cell for cell in members if cell != cause)
        return False

    async def _broadcast(self, version: int, weights: dict[str, torch.Tensor]) -> list[str]:
        """The cells that applied the version (no group or a failed broadcast: none, the
        group torn down for the next publication to open afresh; the core goes on)."""
        from services.engine.weights import broadcast_rank0

        if not await self._ensure_group(version):
            return []
        names = list(weights)
        tensors = [weights[n].detach().contiguous().cpu() for n in names]
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        group, members = self._group, self._members

        def send() -> None:
            for t in tensors:
                broadcast_rank0(group, t)

        receives = [self.clients[cell].update_weights_from_distributed(names, dtypes, shapes, self.group_name,
                                                                       weight_version=str(version))
                    for cell in members]
        sent, *received = await asyncio.gather(asyncio.to_thread(send), *receives, return_exceptions=True)
        if isinstance(sent, BaseException):  # the group itself failed: no cell has this version
            log.error("broadcasting v%d failed: %r (cells: %s); the next publication opens a new group", version,
                      sent, ", ".join(f"{cell}: {'ok' if not isinstance(a, BaseException) else repr(a)}"
                                      for cell, a in zip(members, received)))
            self._bench([cell for cell, a in zip(members, received) if isinstance(a, BaseException)],
                        f"its receive of v{version} failed")
            await self.close()  # a broken group is never reused
            return []
        done = []
        for cell, answer in zip(members, received):  # a cell may refuse (e.g. reject mode) or fail alone
            if isinstance(answer, BaseException):
                log.warning("v%d broadcast but not applied on %s: %r", version, cell, answer)
            else:
                done.append(cell)
        return done

    async def close(self) -> None:
        """Leaves the broadcast group on every cell and here (distributed mode)."""
        if self._group is None:
            return
        from services.engine.weights import leave_weight_group

        group, self._group, self._store, self._members = self._group, None, None, ()
        await self._leave_cells(self.clients)
        leave_weight_group(group)

    async def _leave_cells(self, cells) -> None:
        async def leave(cell: str) -> None:
            try:
                await asyncio.wait_for(self.clients[cell].destroy_weights_update_group(self.group_name),
                                       self.join_timeout_s)
            except Exception as exc:  # the cell may be gone already, or never joined
                log.warning("leaving the weight group on %s failed: %r", cell, exc)

        await asyncio.gather(*(leave(cell) for cell in cells))  # one hung cell does not hold the others

    async def _open_group(self, members: tuple[str, ...]) -> dict[str, BaseException]:
        """Opens the group with ``members``; returns the cells that could not join (empty:
        the group is open). On any failure nothing is left open here: the store this rank
        hosts is stopped at once, which makes every rank still waiting in the rendezvous
        fail within moments, and the cells that did join are told to leave."""
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.join_timeout_s)
        world = 1 + len(members)
        try:  # hosted here, apart from this rank's own connection, so that it can be stopped
            server = dist.TCPStore(self.master_address, self.master_port, is_master=True,
                                   wait_for_workers=False, timeout=timeout, multi_tenant=False)
        except Exception as exc:  # port taken, address not local
            return {"(rank 0)": exc}
        hosted = [server]
        del server

        def stop() -> None:
            hosted.clear()  # the last reference: the store's server stops, its port is free

        def rank0():
            from torch.distributed import distributed_c10d as c10d

            try:
                client = dist.TCPStore(self.master_address, port, is_master=False, timeout=timeout)
                # the same helper (and store key layout) as join_weight_group on the cells
                group, _ = c10d._new_process_group_helper(
                    world, 0, [], dist.Backend("gloo"), dist.PrefixStore(self.group_name, client),
                    group_name=self.group_name, timeout=timeout)
                c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
                return group
            except BaseException:
                order.append(0)
                stop()
                raise

        async def join(rank: int, client):
            try:
                return await asyncio.wait_for(
                    client.init_weights_update_group(self.master_address, port, rank, world, self.group_name),
                    self.join_timeout_s + 10)
            except BaseException:
                order.append(rank)
                await settle()
                stop()  # the group cannot form: let every other rank fail now, not at its timeout
                raise

        async def settle() -> None:
            """Gives the cells still joining a moment (at most 5 s) to reach the store before
            it stops: a cell that connects only after it stopped would retry until its own
            timeout. torch's rendezvous leaves no count of connected ranks to wait on, so
            this is a plain bounded wait."""
            if hosted:
                await asyncio.sleep(min(5.0, self.join_timeout_s))

        port, order = hosted[0].port, []  # order: the ranks as they failed (the first is the cause)
        opened, *joined = await asyncio.gather(
            asyncio.to_thread(rank0), *(join(1 + i, self.clients[c]) for i, c in enumerate(members)),
            return_exceptions=True)
        failed = {cell: exc for cell, exc in zip(members, joined) if isinstance(exc, BaseException)}
        if not failed and not isinstance(opened, BaseException):
            self._group, self._store, self._members = opened, hosted[0], members
            return {}
        stop()
        if isinstance(opened, BaseException):
            failed["(rank 0)"] = opened
        else:
            from services.engine.weights import leave_weight_group

            leave_weight_group(opened)
        # every cell, the failed ones too: a cell that holds a group of ours from before (a
        # core that restarted, a join that timed out here but succeeded there) refuses every
        # join until it leaves; a cell with no group just says so
        await self._leave_cells(list(self.clients))
        names = ["(rank 0)", *members]
        return {names[r]: failed[names[r]] for r in order if names[r] in failed} | failed
