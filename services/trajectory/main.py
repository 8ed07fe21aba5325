"""Wiring for ``gyre serve trajectory``: settings and live handles in, the service running.

The lead registers ``SPEC`` in ``gyre/services.py``. Options (from the command line, or
from ``GYRE_TRAJECTORY_<OPTION>`` variables, which is how ``gyre up`` passes the run
config's ``loss.sample_budget`` and ``trainer.micro_step_tokens``): ``budget``, ``seed``,
``micro_step_tokens``, ``max_piece_tokens``, ``group_size``, ``train_undelivered``,
``advantage_scale`` (``std`` | ``none``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from libs.common.service import ServiceContext, ServiceSpec

from .advantages import AdvantageConfig
from .forks import (CLAUDE_CODE_CONTINUATION_TEXTS, CLAUDE_CODE_SUMMARY_TEXTS, HARNESS_RULES,
                    markers_from_texts)
from .ledger import LedgerConfig
from .service import create_service


def harness_rules(encode: Callable[[str], Sequence[int]] | None = None) -> dict:
    """The harness presets; with the policy's tokenizer, Claude Code's compaction is
    recognised by its instruction tokens as well as in hindsight."""
    rules = dict(HARNESS_RULES)
    if encode is not None:
        for name in ("claude_code", "gyre_agent"):
            rules[name] = rules[name].with_markers(
                summary=markers_from_texts(encode, CLAUDE_CODE_SUMMARY_TEXTS),
                continuation=markers_from_texts(encode, CLAUDE_CODE_CONTINUATION_TEXTS))
    return rules


def ledger_config(run_id: str, options: dict[str, Any],
                  encode: Callable[[str], Sequence[int]] | None = None) -> LedgerConfig:
    def opt(name, cast, default):
        value = options.get(name)
        return default if value is None else cast(value)

    return LedgerConfig(
        run_id=run_id,
        budget=opt("budget", int, 5),
        seed=opt("seed", int, 0),
        micro_step_tokens=opt("micro_step_tokens", int, 65536),
        max_piece_tokens=opt("max_piece_tokens", int, None),
        group_size=opt("group_size", int, None),
        train_undelivered=opt("train_undelivered", _flag, False),
        advantage=AdvantageConfig(scale=opt("advantage_scale", str, "std")),
        rules=harness_rules(encode),
    )


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


OPTIONS = ("budget", "seed", "micro_step_tokens", "max_piece_tokens", "group_size", "train_undelivered",
           "advantage_scale")


def run_config_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The trajectory options a run config sets (``RunConfig.model_dump()``, or the
    ``config`` of ``RunStarted``): what ``gyre up`` passes to the service, and what a replay
    of the run must use to rebuild the same samples and micro-steps."""
    loss, trainer = config.get("loss") or {}, config.get("trainer") or {}
    out: dict[str, Any] = {}
    if loss.get("sample_budget") is not None:
        out["budget"] = int(loss["sample_budget"])
    if trainer.get("micro_step_tokens") is not None:
        out["micro_step_tokens"] = int(trainer["micro_step_tokens"])
    return out


def env_options(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``options`` plus each ``GYRE_TRAJECTORY_<OPTION>`` that is set and not given already."""
    extra = {name: environ[f"GYRE_TRAJECTORY_{name.upper()}"] for name in OPTIONS
             if environ.get(f"GYRE_TRAJECTORY_{name.upper()}") and name not in options}
    return {**options, **extra}


async def trajectory_main(ctx: ServiceContext) -> None:
    # TODO(tokenizer): pass the policy tokenizer's encode once libs/common loads it.
    config = ledger_config(ctx.runtime.settings.run_id, env_options(ctx.options, os.environ))
    service = create_service(config, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs)
    ctx.health.ok(run_id=config.run_id, budget=config.budget)
    await service.run(ctx.stop)


SPEC = ServiceSpec("trajectory", trajectory_main,
                   summary="merges calls into trajectory trees, samples branches, queues micro-steps")
