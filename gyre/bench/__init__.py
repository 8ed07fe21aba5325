"""Benchmarks run by ``gyre bench <name> [--json]``: name -> (function, summary).

Each function takes ``n`` (size, None = default) and ``progress`` and returns one flat
dict, printed as a JSON object on the last line with ``--json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _bus(**kw: Any) -> dict[str, Any]:
    from gyre.bench.bus import run_bus_bench

    return run_bus_bench(**kw)


def _tree(n: int | None = None, progress: bool = True, **params: Any) -> dict[str, Any]:
    """``params``: ``preset`` (default | small), ``budget``, ``verify`` and any field of
    ``services.trajectory.workload.WorkloadPreset`` (``main_turns``, ``compact_at``, ``seed``...)."""
    from dataclasses import fields

    from services.trajectory.bench import run_bench
    from services.trajectory.workload import WorkloadPreset

    known = {f.name for f in fields(WorkloadPreset)} | {"preset", "budget", "verify", "max_piece_tokens"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown tree benchmark parameter(s) {unknown}; known: {sorted(known)}")
    return run_bench(**({"preset": "small"} if n == 1 else {}), **params)


def _proxy(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from services.proxy.bench import run_bench

    return run_bench(turns=n or 50, progress=progress)


def _sim(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from services.scheduler.sim.bench import run_bench

    return run_bench("seed-nl2repo", steps=n or 48, png="docs/sim/roles-seed-nl2repo.png")


def _switch(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from services.cell.bench import run_bench

    return run_bench(progress=progress)


def _transfer(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from libs.common.transfer.bench import run_bench

    return run_bench("transfer", **({"total_mib": n} if n else {}))


def _migrate(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from libs.common.transfer.bench import run_bench

    return run_bench("migrate", cells="services.engine.kv_bench:bench_cells")


def _engine(n: int | None = None, progress: bool = True) -> dict[str, Any]:
    from services.engine.bench import run_bench

    return run_bench()


def _train(n: int | None = None, progress: bool = True, backend: str = "torch") -> dict[str, Any]:
    from services.trainer.bench import run_bench

    return run_bench(backend)


BENCHMARKS: dict[str, tuple[Callable[..., dict[str, Any]], str]] = {
    "bus": (_bus, "raw nats-py vs Gyre's bus: publish and durable consume rates (ratios >= 0.8)"),
    "engine": (_engine, "embedded engine vs transformers generate (batch 1 and 8) and the prefix cache on a 4k prefix"),
    "train": (_train, "tree-packed training vs per-branch training: tokens, step time, loss equality (--backend)"),
    "tree": (_tree, "trajectory trees: storage and training-token savings of prefix merging (--n 1: small)"),
    "proxy": (_proxy, "recording proxy overhead vs the same /generate bodies sent direct (1k/32k/256k contexts)"),
    "switch": (_switch, "embedded cell switches inference<->training with live sessions vs a cold engine restart"),
    "transfer": (_transfer, "block transfer throughput: Mooncake and UCX over loopback TCP vs memcpy (--n MiB)"),
    "migrate": (_migrate, "KV migration between two embedded engines vs re-prefill, at 8k and 32k tokens"),
    "sim": (_sim, "the scheduler simulator on the seed workload (as `gyre sim --json`, and writes "
                   "docs/sim/roles-seed-nl2repo.png under the current folder; --n steps)"),
}
