"""An example Gyre plugin (install with `pip install -e examples/plugins/gyre_example_plugin`).

- ``harness``: a one-call harness (``echo.py``): the task text in, one chat completion;
- ``fork_rules``: its trajectories read like a generic tool-calling agent's;
- ``has_readme``: a scorer giving 1.0 when the agent left a README in its workspace; a run
  uses it with ``evaluator: {scorers: {has_readme: 0.25}}`` (the weight in the score).
"""

from __future__ import annotations

from pathlib import Path


def harness():
    from services.runner.harness import HarnessConfig

    return HarnessConfig(name="echo_agent",
                         command=("{python}", "-m", "gyre_example_plugin.echo", "{prompt_file}", "{model}"))


def fork_rules():
    from services.trajectory.forks import HarnessRules

    return HarnessRules("echo_agent", ("agent_id", "system_digest"), "first_seen", False)


def has_readme(workspace: Path, task: dict) -> float:
    return 1.0 if (Path(workspace) / "README.md").exists() else 0.0
