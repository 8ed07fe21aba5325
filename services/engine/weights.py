"""Weight updates (disk, tensor, gloo broadcast) and memory release/resume for the engine.

Rules that keep answers correct:

- Every update is checked whole (names, shapes, dtypes) before anything is written; a bad
  one raises :class:`WeightUpdateError` (HTTP 400) and the old weights stay.
- Writes happen on the engine thread between steps: at once when the engine is idle or
  paused. Otherwise ``weight_update_mode`` decides: ``wait`` (:meth:`Engine.call_when_idle`)
  holds new requests and writes once the running ones finish; ``reject`` refuses the update
  with :class:`WeightUpdateRefused` (HTTP 400, nothing written), decided on the engine thread
  in the same command that would write, so no step can start in between. A forward step
  never sees a half-applied update.
- A distributed update is checked only after the whole broadcast was received into
  scratch buffers: the trainer's collective always completes and the group stays in step
  (refusing before the receive would leave the trainer's tensors in the group, and the
  next update would read them as its own); a refused update's tensors are dropped. Only an
  announcement that cannot be read (unknown dtype, bad shape, lists of different lengths)
  is refused before receiving, since there is nothing to receive into.
- Between ``begin_weight_update`` and ``end_weight_update`` tensor and distributed updates
  are staged and applied together at the end (all or nothing). Without ``begin`` each call
  applies at once, as SGLang before 0.5.21 did. In ``reject`` mode only ``end`` can be
  refused (staging writes nothing); a refused ``end`` closes the window and drops what was
  staged. An ``end`` while the weights are released is refused too, but keeps the window:
  resume memory, then end again.
- One window at a time: a ``begin_weight_update`` while another window is open waits for
  that one to end (the cell agent's catch-up push and the trainer's publication may meet on
  a cell; each window's updates then stay its own, and each end applies and labels only
  what its owner sent). A window with no update running and nothing heard of it for
  ``WINDOW_IDLE_S`` is abandoned (its owner died between begin and end): the waiting begin
  drops it (that owner's end is then refused) and opens its own.
- A window never stays open behind a failure (so a ``success`` answer never means "staged
  in a window nobody will end"): a tensor, distributed or pull update that fails while a
  window is open drops the window and what it staged (:meth:`WeightManager.guard`), and
  ``end_weight_update {"abort": true}`` (a Gyre extension; the client sends it when the
  body of its window raised) drops it on purpose. Every later update then applies at once
  again. An ``end`` with no window open is refused (400, naming why the last window was
  dropped) rather than answering success for nothing applied.
- Every applied update flushes the prefix cache (cached KV of old weights is stale) and
  bumps ``Engine.weight_generation``: a sequence paused in place across the update keeps
  its old-weight KV to finish, but that KV never goes back into the cache.
"""

from __future__ import annotations

import base64
import datetime
import io
import logging
import pickle
import tempfile
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from .engine import EngineBusy

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)
# a window whose owner has run no update and said nothing for this long is abandoned: a
# begin waiting behind it drops it
WINDOW_IDLE_S = 60.0
ABORTED_FOR_UPDATE = "aborted for a weight update"


class WeightUpdateError(ValueError):
    """A weight update refused before any weight changed."""


class WeightUpdateRefused(WeightUpdateError):
    """``weight_update_mode=reject``: the update found requests running and generation not
    paused; nothing was written and the running requests go on with the old weights."""


def wire_dtype(name) -> torch.dtype:
    """Any torch dtype by name (``"bfloat16"``, ``"torch.int64"``): what a broadcast carries.
    Whether weights may take it is :meth:`WeightManager.check`'s call."""
    value = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return value


def wire_shape(name, shape) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise WeightUpdateError(f"shape of {name} must be a list of non-negative sizes, got {shape!r}")
    return tuple(shape)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """Client side of ``/update_weights_from_tensor`` (same wire form as SGLang's: a
    base64 ForkingPickler dump; tensors travel through shared memory, so the caller keeps
    them alive until the call returns)."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    # Unpickling runs code chosen by the sender: the endpoint is admin-only, as in SGLang.
    import torch.multiprocessing  # noqa: F401  (registers the shared-memory rebuild functions)

    try:
        named = pickle.loads(base64.b64decode(payload))
    except Exception as exc:
        raise WeightUpdateError(f"cannot decode serialized_named_tensors: {exc}") from None
    if not isinstance(named, (list, tuple)) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in named
    ):
        raise WeightUpdateError("serialized_named_tensors must hold a list of (name, tensor)")
    return [(str(name), tensor) for name, tensor in named]


class WeightManager:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.params = engine.runner.named_parameters()
        self.aliases = engine.runner.tied_aliases()
        self.staged: dict[str, torch.Tensor] | None = None  # open begin/end window
        self.group: torch.distributed.ProcessGroup | None = None
        self.group_name: str | None = None
        self._store = None
        self._parked: Path | None = None
        self._staged_version: str | None = None
        self._dropped: str | None = None  # why the last window closed without being applied
        self._touched = 0.0  # when the open window's owner was last heard from (begin, an update)
        self._updating = 0  # updates running inside guard()

    # -- checks ----------------------------------------------------------------------
    def resolve(self, name: str) -> str:
        name = self.aliases.get(name, name)
        if name not in self.params:
            raise WeightUpdateError(f"unknown weight name {name!r}")
        return name

    def check(self, name: str, shape: Iterable[int], dtype: torch.dtype) -> str:
        key = self.resolve(name)
        want = tuple(self.params[key].shape)
        if "weights" in self.engine.released:
            raise WeightUpdateError("weights are released; resume_memory_occupation first")
        if tuple(shape) != want:
            raise WeightUpdateError(f"shape of {name} is {tuple(shape)}, expected {want}")
        if not dtype.is_floating_point:
            raise WeightUpdateError(f"dtype of {name} is {dtype}; weights are floating point")
        return key

    def check_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        checked: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            key = self.check(name, tensor.shape, tensor.dtype)
            # checked before anything is written: a tensor copy_ cannot read (meta, sparse,
            # another device) would fail half-way through an update
            if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided \
                    or tensor.device.type != "cpu":
                where = f"{tensor.layout}, {tensor.device}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise WeightUpdateError(f"{name}: a dense CPU tensor is needed, not one that is {where}")
            checked[key] = tensor
        return checked

    # -- applying ----------------------------------------------------------------------
    def begin(self) -> None:
        self.staged, self._staged_version, self._dropped = {}, None, None
        self._touched = time.monotonic()

    def window_busy(self) -> bool:
        """A window is open and in use: an update inside it runs, or its owner was heard from
        (begin, an update) less than ``WINDOW_IDLE_S`` ago. A new begin waits while so."""
        if self.staged is None:
            return False
        return self._updating > 0 or time.monotonic() - self._touched < WINDOW_IDLE_S

    def drop_window(self, reason: str) -> bool:
        """Closes an open window without applying what it staged; False when none was open."""
        if self.staged is None:
            return False
        self.staged, self._staged_version, self._dropped = None, None, reason
        log.info("weight update window dropped, nothing of it applied: %s", reason)  # its owner gets the error
        return True

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around one tensor, distributed or pull update: if it fails while a window is open,
        the window is dropped (its owner's ``end`` is then refused), so later updates that
        open no window of their own apply at once instead of being staged for good."""
        self._updating += 1
        try:
            yield
        except BaseException as exc:
            self.drop_window(f"an update inside it failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._updating -= 1
            self._touched = time.monotonic()

    def end(self, weight_version: str | None, abort: bool = False) -> Future:
        """Applies the open window (a future of the apply); ``abort`` drops it instead (no
        window open: nothing to do). An ``end`` with no window open is refused."""
        if abort:
            self.drop_window("aborted by its owner (end_weight_update with abort)")
            done: Future = Future()
            done.set_result(0)
            return done
        if self.staged is None:
            why = f" (the last one was dropped: {self._dropped})" if self._dropped else ""
            raise WeightUpdateError(f"no weight update window is open{why}; nothing applied")
        if "weights" in self.engine.released:  # refused with the window kept: end again after resuming
            raise WeightUpdateError("weights are released; resume_memory_occupation, then end the update again")
        staged, self.staged = self.staged, None  # a refused end (reject mode) drops the window too
        version = weight_version if weight_version is not None else self._staged_version

        def write() -> int:
            if "weights" in self.engine.released:  # released since the check above: keep the window
                if self.staged is None:
                    self.staged = staged
                raise WeightUpdateError("weights are released; resume_memory_occupation, then end the update again")
            return self._write(staged, version)

        return self._schedule(write)

    def submit(self, checked: dict[str, torch.Tensor], weight_version: str | None) -> Future:
        """Stages (inside begin/end) or applies ``checked``; returns a future of the apply."""
        if self.staged is not None:
            self.staged.update({k: v.detach().clone() for k, v in checked.items()})
            if weight_version is not None:
                self._staged_version = weight_version
            done: Future = Future()
            done.set_result(0)
            return done
        return self._schedule(lambda: self._write(checked, weight_version))

    def apply_now(self, checked: dict[str, torch.Tensor], weight_version: str | None,
                  abort_all_requests: bool = False) -> Future:
        """Applies outside any begin/end window (disk updates), after aborting every request
        when asked (then nothing runs, so neither mode waits or refuses)."""
        return self._schedule(lambda: self._write(checked, weight_version), abort_first=abort_all_requests)

    def _schedule(self, write: Callable[[], int], abort_first: bool = False) -> Future:
        """Runs ``write`` on the engine thread per ``weight_update_mode`` (module docstring)."""
        engine = self.engine
        if engine.settings.weight_update_mode == "reject":
            def unless_generating() -> int:
                if abort_first:
                    engine.abort(None, ABORTED_FOR_UPDATE)
                running = len(engine.scheduler.running)
                if running and engine.scheduler.paused is None:
                    raise WeightUpdateRefused(
                        f"weight update refused: {running} request(s) running and generation not paused "
                        f"(weight_update_mode=reject); nothing applied, weights stay at version "
                        f"{engine.weight_version!r}. Pause generation or retry when idle.")
                return write()

            return engine.call(unless_generating)
        if abort_first:  # queued just before the write; a request admitted in between is waited for
            engine.call(lambda: engine.abort(None, ABORTED_FOR_UPDATE))
        return engine.call_when_idle(write)

    def _write(self, checked: dict[str, torch.Tensor], weight_version: str | None) -> int:
        """Engine thread. Returns how many requests were paused across the update."""
        if "weights" in self.engine.released:  # the parameters are parked on disk: nothing to write into
            raise WeightUpdateError("weights are released; resume_memory_occupation first")
        try:
            with torch.no_grad():
                for key, tensor in checked.items():
                    self.params[key].data.copy_(tensor.to(torch.float32))
        except Exception as exc:  # checked above, so not expected; but then no cache may outlive it
            self.engine.runner.weights_changed()
            self.engine.weight_generation += 1
            self.engine.prefix_cache.flush()
            raise WeightUpdateError(f"weight update failed part-way ({exc}); the weights are mixed, load a whole "
                                    f"version again") from exc
        self.engine.runner.weights_changed()
        self.engine.weight_generation += 1  # KV of live (paused) sequences is stale from here on
        if weight_version is not None:
            self.engine.weight_version = str(weight_version)
        self.engine.prefix_cache.flush()
        paused = self.engine.scheduler.paused
        return len(self.engine.scheduler.running) if paused is not None else 0

    # -- sources -----------------------------------------------------------------------
    def load_from_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        folder = Path(model_path)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
        if not files or not all(f.is_file() for f in files):
            raise WeightUpdateError(f"no safetensors weights at {model_path}")
        named: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                named.update(load_file(str(file)))
            except Exception as exc:  # not safetensors, truncated, unreadable: nothing applied
                raise WeightUpdateError(f"cannot read {file} as safetensors: {exc}") from None
        checked = self.check_all(named.items())
        missing = sorted(set(self.params) - set(checked))
        if missing:
            raise WeightUpdateError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        return checked

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float = 600.0) -> None:
        """Joins the trainer's broadcast group (blocks until every rank has joined)."""
        if backend != "gloo":
            raise WeightUpdateError(f"backend {backend!r} is not available on CPU; use gloo")
        if self.group is not None:
            raise WeightUpdateError(f"already in weight update group {self.group_name!r}")
        try:
            self.group, self._store = join_weight_group(
                master_address, master_port, rank_offset, world_size, group_name, timeout_s
            )
        except (RuntimeError, ValueError) as exc:  # store unreachable, timeout, bad rank
            raise WeightUpdateError(f"cannot join weight update group {group_name!r}: {exc}") from None
        self.group_name = group_name

    def receive_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                          group_name: str) -> dict[str, torch.Tensor]:
        """Receives one tensor per name from rank 0 (call off the engine thread).

        The trainer broadcasts whatever it announced whether or not this cell accepts it, so
        every announced tensor that can be allocated is received (into scratch buffers)
        before anything is checked: a refusal then leaves the group in step, and the next
        update reads its own bytes, not this one's. Only an announcement that cannot be
        read (no group, lists of different lengths, an unknown dtype, a bad shape) is
        refused before receiving; nothing is applied either way."""
        if self.group is None or group_name != self.group_name:
            raise WeightUpdateError(f"no weight update group {group_name!r}; call init_weights_update_group")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError("names, dtypes and shapes must be non-empty and of one length")
        plan = [(str(name), wire_dtype(dt), wire_shape(name, shape)) for name, dt, shape in zip(names, dtypes, shapes)]
        try:
            scratch = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in plan]
        except (RuntimeError, MemoryError) as exc:
            raise WeightUpdateError(f"cannot allocate the announced tensors: {exc}") from None
        for name, tensor in scratch:
            try:
                broadcast_rank0(self.group, tensor)
            except RuntimeError as exc:  # the trainer went away mid-update: nothing written
                raise WeightUpdateError(f"broadcast of {name} failed: {exc}") from None
        return self.check_all(scratch)

    def destroy_group(self, group_name: str | None) -> None:
        if self.group is None or (group_name is not None and group_name != self.group_name):
            raise WeightUpdateError(f"no weight update group {group_name!r}")
        leave_weight_group(self.group)
        self.group, self._store, self.group_name = None, None, None

    # -- memory ------------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        """Engine thread: parks weights on disk and/or drops the KV cache (idle only)."""
        if self.engine.scheduler.busy():
            raise EngineBusy("release_memory_occupation needs an idle engine")
        if "kv_cache" in tags:
            self.engine.prefix_cache.flush()
            self.engine.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.engine.released:
            from safetensors.torch import save_file

            root = self.engine.settings.scratch_dir
            folder = Path(tempfile.mkdtemp(prefix="gyre-released-", dir=str(root) if root else None))
            self._parked = folder / "weights.safetensors"
            save_file({k: p.data.contiguous() for k, p in self.params.items()}, str(self._parked))
            for param in self.params.values():
                param.data = torch.empty(0)
            self.engine.runner.weights_changed()  # frees the packed output matrix too
            self.engine.released.add("weights")

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.engine.released and self._parked is not None:
            from safetensors.torch import load_file

            loaded = load_file(str(self._parked))
            for key, param in self.params.items():
                param.data = loaded[key]
            self.engine.runner.weights_changed()
            self._parked.unlink()
            self._parked.parent.rmdir()
            self._parked = None
            self.engine.released.discard("weights")
        if "kv_cache" in tags:
            self.engine.released.discard("kv_cache")


def join_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout_s: float = 600.0):
    """A gloo group for weight broadcasts that SGLang servers can join too.

    Both sides use it: the trainer as rank 0 (it hosts the TCP store), each cell with its
    rank. It rendezvouses the way SGLang's ``/init_weights_update_group`` does (a TCP store
    at ``tcp://address:port``, keys under ``group_name``, then torch's own group helper), so
    one trainer can feed embedded engines and SGLang servers alike; torch's default process
    group is neither needed nor touched. Returns (group, store); keep both while in use.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    # torch's private helper is what SGLang calls; its store key layout is the contract.
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], dist.Backend("gloo"), dist.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # lets dist.broadcast(group=) work
    return group, store


def leave_weight_group(group) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError) as exc:  # already gone: nothing left to free
        log.debug("destroying weight group: %s", exc)


def broadcast_rank0(group, tensor: torch.Tensor) -> None:
    """One broadcast from rank 0 over a group from :func:`join_weight_group` (both sides)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()
