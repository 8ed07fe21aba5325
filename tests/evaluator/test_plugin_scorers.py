"""Scorer plugins: the evaluator finds them through the ``gyre.scorers`` entry points (the
example plugin, installed as a distribution for the test), runs the configured ones on the
rollout's workspace and folds them into the score with their weights."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from libs.common.events import RolloutScored, RolloutScoringFailed
from services.evaluator.adapters.plugin_scorers import ScorerNotFound, load_scorers
from services.evaluator.settings import EvaluatorSettings

from ._workspaces import CALC_OK, CALC_PARTIAL, calc_spec, tar_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed_plugins(tmp_path, monkeypatch):
    """The example plugin as an installed distribution, plus one misbehaving scorer."""
    site = tmp_path / "site"
    for dist, entries in (("gyre_example_plugin-0.1.0", "has_readme = gyre_example_plugin:has_readme\n"),
                          ("bad_scorer-0.1.0", "too_big = bad_scorer:too_big\nraises = bad_scorer:raises\n")):
        info = site / f"{dist}.dist-info"
        info.mkdir(parents=True)
        name = dist.rsplit("-", 1)[0].replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text("[gyre.scorers]\n" + entries)
    (site / "bad_scorer.py").write_text(
        "def too_big(workspace, task):\n    return 2.0\n\n"
        "def raises(workspace, task):\n    raise RuntimeError('no luck')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins" / "gyre_example_plugin"))
    importlib.invalidate_caches()
    yield
    for mod in ("gyre_example_plugin", "bad_scorer"):
        sys.modules.pop(mod, None)


async def test_a_configured_scorer_adds_a_weighted_component(installed_plugins, make_harness):
    h = await make_harness(scorers={"has_readme": 0.25})
    assert list(h.evaluator.scorers) == ["has_readme"]
    with_readme = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK, "README.md": "# calc\n"}))
    assert isinstance(with_readme, RolloutScored), with_readme
    assert with_readme.score == 1.0
    assert with_readme.components == {"tests": 1.0, "plugin:has_readme": 1.0}
    without = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK}))
    assert isinstance(without, RolloutScored)
    assert without.score == pytest.approx(1.0 / 1.25)  # (tests 1.0 + 0.25 * 0.0) / 1.25
    assert without.components["plugin:has_readme"] == 0.0
    if "reason" in RolloutScored.model_fields:
        assert "has_readme 0.000 (weight 0.25)" in without.reason


async def test_weight_zero_records_the_component_only(installed_plugins, make_harness):
    h = await make_harness(scorers={"has_readme": 0})
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_PARTIAL, "README.md": "x"}), timed_out=True)
    assert isinstance(ev, RolloutScored) and ev.partial
    assert ev.score == 0.25 and ev.components == {"tests": 0.25, "plugin:has_readme": 1.0}


@pytest.mark.parametrize("name, why", [("too_big", "returned 2.0, not a score in [0, 1]"),
                                       ("raises", "failed: RuntimeError('no luck')")])
async def test_a_misbehaving_scorer_fails_the_scoring_by_name(installed_plugins, make_harness, name, why):
    h = await make_harness(scorers={name: 1.0})
    ev = await h.score(calc_spec(), tar_of({"calc.py": CALC_OK}))
    assert isinstance(ev, RolloutScoringFailed)
    assert f"scorer plugin {name} {why}" in ev.reason


def test_an_unknown_scorer_is_refused_with_what_is_installed(installed_plugins):
    with pytest.raises(ScorerNotFound, match=r"nope: not installed \(installed gyre.scorers entry points: "
                                             r"has_readme, raises, too_big\)"):
        load_scorers({"nope": 1.0})
    assert load_scorers([]) == {}


def test_scorers_come_from_the_run_config_to_the_evaluator_settings(monkeypatch):
    from gyre.up import plan_stack
    from libs.common.runconfig import load_run_config

    cfg = load_run_config(None, ["evaluator.scorers={has_readme: 0.25}", "cells.count=0"])
    (evaluator,) = [launch for launch in plan_stack(cfg, "tok") if launch.service == "evaluator"]
    monkeypatch.setenv("GYRE_EVALUATOR_SCORERS", evaluator.env["GYRE_EVALUATOR_SCORERS"])
    assert EvaluatorSettings().scorers == {"has_readme": 0.25}
    monkeypatch.setenv("GYRE_EVALUATOR_SCORERS", json.dumps({"has_readme": -1}))
    with pytest.raises(ValueError, match="scorer weights must be finite and >= 0"):
        EvaluatorSettings()


def test_workers_and_judge_come_from_the_run_config_to_the_evaluator_settings(monkeypatch):
    from gyre.up import plan_stack
    from libs.common.runconfig import RunConfigError, load_run_config

    cfg = load_run_config(None, ["evaluator.workers=5", "evaluator.judge_url=http://127.0.0.1:9/v1",
                                 "evaluator.judge_model=judge", "cells.count=0"])
    (evaluator,) = [launch for launch in plan_stack(cfg, "tok") if launch.service == "evaluator"]
    for key, value in evaluator.env.items():
        if key.startswith("GYRE_EVALUATOR_"):
            monkeypatch.setenv(key, value)
    settings = EvaluatorSettings()
    assert settings.workers == 5
    assert settings.judge is not None and (settings.judge.base_url, settings.judge.model) == ("http://127.0.0.1:9/v1", "judge")
    with pytest.raises(RunConfigError, match="judge_url and judge_model go together"):
        load_run_config(None, ["evaluator.judge_url=http://127.0.0.1:9/v1"])
