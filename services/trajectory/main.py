"""Wiring for ``gyre serve trajectory``: settings and live handles in, the service running.

The lead registers ``SPEC`` in ``gyre/services.py``. Options, each from its
``GYRE_TRAJECTORY_<OPTION>`` variable (``ENV`` below; ``gyre serve trajectory`` has no
command-line options for them; ``gyre up`` sets them from the run config's
``loss.sample_budget``, ``trainer.micro_step_tokens``, ``group_size`` and ``model.name``,
``run_config_options``): ``budget`` (branches sampled per execution; default 5),
``seed`` (default 0), ``micro_step_tokens`` (the most tokens in one micro-step; default
65536, ``gyre up``: 8192), ``max_piece_tokens`` (the size a tree larger than that is cut
into; default ``micro_step_tokens``), ``group_size`` (rollouts per group, for groups whose
``RolloutStarted`` states none; default: those started), ``train_undelivered`` (also train
on calls the agent never received; default off), ``advantage_scale`` (``std``, the
default, | ``none``), ``model``.

The policy tokenizer. The service tokenises Claude Code's compaction texts with the
tokenizer the proxy renders with, so that a compaction summary is recognised by its
instruction tokens when it arrives, not only in hindsight (once a continuation follows
it; a summary that none follows, e.g. at a timeout, is otherwise an ``edit``). The model
is found as the proxy finds it: option ``model``, else ``GYRE_MODEL`` (``gyre up`` sets
both to the run config's ``model.name``), else ``tiny-qwen``, the proxy's default;
``services.engine.model_store.resolve_model`` turns the name into a folder and
``AutoTokenizer`` loads it, once per process. If it cannot be loaded the service does not
stop: it logs a warning and reports ``compaction_markers: false`` with the reason in its
health detail, and classifies with the hindsight rules (and the proxy's ``kind`` hints).
The proxy itself cannot serve without that tokenizer, so a missing model stops the run
there, with its own error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libs.common.options import number_option
from libs.common.service import ServiceContext, ServiceSpec

from .advantages import AdvantageConfig
from .forks import (CLAUDE_CODE_CONTINUATION_TEXTS, CLAUDE_CODE_SUMMARY_TEXTS, HARNESS_RULES,
                    markers_from_texts)
from .ledger import LedgerConfig
from .service import create_service

log = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-qwen"  # the proxy's default (services/proxy/main.py)


@dataclass(frozen=True)
class PolicyTokenizer:
    """The policy's tokenizer as the service holds it: ``encode`` or why there is none."""

    model: str
    encode: Callable[[str], Sequence[int]] | None = None
    folder: str | None = None
    error: str | None = None

    def health(self) -> dict[str, Any]:
        if self.encode is None:
            return {"tokenizer": self.model, "compaction_markers": False, "tokenizer_error": self.error}
        return {"tokenizer": self.folder or self.model, "compaction_markers": True}


def policy_model(options: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The model whose tokenizer the proxy renders with (see the module's docstring)."""
    return str(options.get("model") or environ.get("GYRE_MODEL") or DEFAULT_MODEL)


@functools.lru_cache(maxsize=8)
def load_policy_tokenizer(model: str) -> PolicyTokenizer:
    """Loads ``model``'s tokenizer the way the proxy does (once per process and model);
    never raises: a failure comes back as ``error``."""
    try:
        from transformers import AutoTokenizer

        from services.engine.model_store import resolve_model

        location = resolve_model(model)
        kwargs = {"gguf_file": location.gguf_file} if location.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(str(location.folder), **kwargs)
    except Exception as exc:  # a missing folder, a broken tokenizer, no transformers
        return PolicyTokenizer(model, error=f"{type(exc).__name__}: {exc}")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)  # as the proxy's renderer encodes

    return PolicyTokenizer(model, encode, str(location.folder))


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
    """The service's configuration. Without ``encode``, an option ``model`` (a replay or
    ``gyre tree show`` gets it from the run config, as the live service did) loads that
    model's tokenizer; without either, compaction is recognised in hindsight only."""
    if encode is None and options.get("model"):
        encode = load_policy_tokenizer(str(options["model"])).encode

    def count(name: str, default: int | None, minimum: int | None, must_be: str) -> Any:
        return number_option(options, name, default=default, label=_label(name), must_be=must_be,  # type: ignore[arg-type]
                             integer=True, minimum=minimum)

    scale = options.get("advantage_scale")
    scale = "std" if scale is None or scale == "" else str(scale).strip().lower()
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"{_label('advantage_scale')} must be one of {', '.join(ADVANTAGE_SCALES)}, "
                         f"not {options.get('advantage_scale')!r}")
    return LedgerConfig(
        run_id=run_id,
        budget=count("budget", 5, 1, "a whole number of samples, at least 1"),
        seed=count("seed", 0, None, "a whole number"),
        micro_step_tokens=count("micro_step_tokens", 65536, 1, "a whole number of tokens, at least 1"),
        max_piece_tokens=count("max_piece_tokens", None, 1, "a whole number of tokens, at least 1"),
        group_size=count("group_size", None, 1, "a whole number of rollouts, at least 1"),
        train_undelivered=_flag(options.get("train_undelivered", False), _label("train_undelivered")),
        advantage=AdvantageConfig(scale=scale),  # type: ignore[arg-type]
        rules=harness_rules(encode),
    )


ADVANTAGE_SCALES = ("std", "none")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _label(name: str) -> str:
    return f"{name} ({ENV[name]})"


def _flag(value: Any, label: str = "flag") -> bool:
    if isinstance(value, bool):
        return value
    text = "" if value is None else str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{label} must be true or false (1/0, yes/no, on/off), not {value!r}")


# option -> variable: GYRE_TRAJECTORY_<OPTION>, the names ``gyre up`` sets
ENV = {"budget": "GYRE_TRAJECTORY_BUDGET", "seed": "GYRE_TRAJECTORY_SEED",
       "micro_step_tokens": "GYRE_TRAJECTORY_MICRO_STEP_TOKENS",
       "max_piece_tokens": "GYRE_TRAJECTORY_MAX_PIECE_TOKENS", "group_size": "GYRE_TRAJECTORY_GROUP_SIZE",
       "train_undelivered": "GYRE_TRAJECTORY_TRAIN_UNDELIVERED",
       "advantage_scale": "GYRE_TRAJECTORY_ADVANTAGE_SCALE", "model": "GYRE_TRAJECTORY_MODEL"}
OPTIONS = tuple(ENV)


def run_config_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The trajectory options a run config sets (``RunConfig.model_dump()``, or the
    ``config`` of ``RunStarted``): what ``gyre up`` passes to the service, and what a replay
    of the run must use to rebuild the same samples and micro-steps."""
    loss, trainer, model = config.get("loss") or {}, config.get("trainer") or {}, config.get("model") or {}
    out: dict[str, Any] = {}
    if model.get("name"):
        out["model"] = str(model["name"])  # whose tokenizer gives the compaction markers
    if loss.get("sample_budget") is not None:
        out["budget"] = int(loss["sample_budget"])
    if trainer.get("micro_step_tokens") is not None:
        out["micro_step_tokens"] = int(trainer["micro_step_tokens"])
    if config.get("group_size") is not None:
        out["group_size"] = int(config["group_size"])  # a group is queued once all of it is scored
    return out


def env_options(options: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``options`` plus each ``GYRE_TRAJECTORY_<OPTION>`` that is set and not given already."""
    extra = {name: environ[var] for name, var in ENV.items() if environ.get(var) and name not in options}
    return {**options, **extra}


async def trajectory_main(ctx: ServiceContext) -> None:
    options = env_options(ctx.options, os.environ)
    tokenizer = await asyncio.to_thread(load_policy_tokenizer, policy_model(options, os.environ))
    if tokenizer.encode is None:
        log.warning("trajectory: no policy tokenizer (model %r: %s); Claude Code compactions are recognised "
                    "in hindsight and by the proxy's hints only, a summary no continuation follows is an edit",
                    tokenizer.model, tokenizer.error)
    else:
        log.info("trajectory: compaction markers from the tokenizer in %s", tokenizer.folder)
    config = ledger_config(ctx.runtime.settings.run_id, options, tokenizer.encode)
    service = create_service(config, bus=ctx.runtime.bus, blobs=ctx.runtime.blobs)
    # "ok" either way: gyre up starts the run only once every service reports "ok"
    ctx.health.ok(run_id=config.run_id, budget=config.budget, **tokenizer.health())
    await service.run(ctx.stop)


SPEC = ServiceSpec("trajectory", trajectory_main,
                   summary="merges calls into trajectory trees, samples branches, queues micro-steps")
