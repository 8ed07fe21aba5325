"""Plugins are found through packaging entry points (the example plugin, installed as a
distribution on sys.path for the test), and a broken one is named, not fatal."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from libs.common.plugins import discover

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    """The example plugin as an installed distribution: its package and a dist-info."""
    site = tmp_path / "site"
    dist = site / "gyre_example_plugin-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gyre-example-plugin\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[gyre.harnesses]\necho_agent = gyre_example_plugin:harness\n"
        "[gyre.fork_rules]\necho_agent = gyre_example_plugin:fork_rules\n"
        "[gyre.scorers]\nhas_readme = gyre_example_plugin:has_readme\nbroken = gyre_example_plugin:nope\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins" / "gyre_example_plugin"))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("gyre_example_plugin", None)


def test_the_example_plugin_is_discovered(installed_example, tmp_path) -> None:
    from services.runner import harness
    from services.trajectory.forks import HarnessRules

    harnesses, failures = discover("gyre.harnesses")
    assert harnesses["echo_agent"].name == "echo_agent" and not failures
    assert "echo_agent" in harness.presets() and "gyre_agent" in harness.presets()
    rules, _ = discover("gyre.fork_rules")
    assert isinstance(rules["echo_agent"], HarnessRules)
    scorers, failures = discover("gyre.scorers")
    (tmp_path / "README.md").write_text("hi")
    assert scorers["has_readme"](tmp_path, {}) == 1.0
    assert [f.name for f in failures] == ["broken"] and "AttributeError" in failures[0].error


def test_unknown_group_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown plugin group"):
        discover("gyre.nope")
