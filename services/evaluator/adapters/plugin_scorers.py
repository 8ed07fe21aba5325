"""Scorer plugins: ``score(workspace: Path, task: dict) -> float`` in [0, 1], installed as
``gyre.scorers`` entry points (``libs/common/plugins.py``) and chosen by name in the run
config (``evaluator.scorers: {name: weight}``, here ``EvaluatorSettings.scorers``).

A scorer is trusted code run in the evaluator's process on the unpacked workspace (a
thread, not the sandbox): it may read the files the agent left; it must not run them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Scorer = Callable[[Path, dict[str, Any]], float]


class ScorerNotFound(ValueError):
    """A configured scorer that no installed plugin provides."""


def load_scorers(names: list[str] | tuple[str, ...] | dict[str, float]) -> dict[str, Scorer]:
    """The named scorers from the ``gyre.scorers`` entry points; an unknown or broken name
    is an error that lists what is installed."""
    wanted = list(names)
    if not wanted:
        return {}
    from libs.common.plugins import discover

    found, failures = discover("gyre.scorers")
    broken = {f.name: f.error for f in failures}
    missing = [n for n in wanted if n not in found]
    if missing:
        detail = "; ".join(f"{n}: failed to load ({broken[n]})" if n in broken else f"{n}: not installed"
                           for n in missing)
        installed = ", ".join(sorted(found)) or "none"
        raise ScorerNotFound(f"scorer plugins {detail} (installed gyre.scorers entry points: {installed})")
    not_callable = [n for n in wanted if not callable(found[n])]
    if not_callable:
        raise ScorerNotFound(f"scorer plugins {', '.join(not_callable)} are not callables score(workspace, task)")
    return {n: found[n] for n in wanted}
