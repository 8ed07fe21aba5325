"""Extension points: users add harness adapters, evaluator scorers and fork-classification
rules as Python packages, through packaging entry points, without forking Gyre.

| group | an entry point names | used by |
|---|---|---|
| ``gyre.harnesses`` | a ``services.runner.harness.HarnessConfig`` (or a function returning one) | the runner (``harness.name`` in the run config) |
| ``gyre.fork_rules`` | a ``services.trajectory.forks.HarnessRules`` (or a function returning one) | the trajectory service, by the rollout's harness name |
| ``gyre.scorers`` | ``score(workspace: Path, task: dict) -> float`` in [0, 1] | the evaluator, as a weighted score component (``evaluator.scorers: {name: weight}`` in the run config) |

Declare them in the plugin's ``pyproject.toml``::

    [project.entry-points."gyre.harnesses"]
    my_agent = "my_pkg.gyre_plugin:harness"

A plugin that fails to load is reported by name with its error and left out; Gyre's own
presets always win a name clash (a plugin cannot silently replace them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)

GROUPS = ("gyre.harnesses", "gyre.fork_rules", "gyre.scorers")


@dataclass(frozen=True)
class PluginError:
    group: str
    name: str
    error: str


def discover(group: str, *, call_factories: bool = True) -> tuple[dict[str, Any], list[PluginError]]:
    """Load every entry point of ``group``: (name -> object, failures)."""
    if group not in GROUPS:
        raise ValueError(f"unknown plugin group {group!r}; groups: {', '.join(GROUPS)}")
    found: dict[str, Any] = {}
    failures: list[PluginError] = []
    for ep in entry_points(group=group):
        try:
            obj = ep.load()
            if call_factories and callable(obj) and not isinstance(obj, type) and group != "gyre.scorers":
                obj = obj()
        except Exception as exc:  # a broken plugin must not take Gyre down: name it and go on
            failures.append(PluginError(group, ep.name, f"{type(exc).__name__}: {exc}"))
            log.error("plugin %s in %s failed to load: %r", ep.name, group, exc)
            continue
        found[ep.name] = obj
    return found, failures


def merged(builtin: dict[str, Any], group: str) -> dict[str, Any]:
    """Built-in entries plus plugins; built-ins keep their names."""
    plugins, _ = discover(group)
    return {**{k: v for k, v in plugins.items() if k not in builtin}, **builtin}
