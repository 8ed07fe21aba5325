"""``gyre bench tree --set key=value``: the workload generator's parameters as flags."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gyre.cli import app


def test_workload_parameters_reach_the_generator():
    out = CliRunner().invoke(app, ["bench", "tree", "--json", "--set", "preset=small", "--set", "rollouts=1",
                                   "--set", "main_turns=30", "--set", "verify=false"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["preset"] == "small" and result["rollouts"] == 1 and result["calls"] < 200


def test_unknown_parameters_and_wrong_benchmarks_are_clear_errors():
    out = CliRunner().invoke(app, ["bench", "tree", "--set", "bogus=1"])
    assert out.exit_code == 2 and "bogus" in out.output and "main_turns" in out.output
    out = CliRunner().invoke(app, ["bench", "engine", "--set", "x=1"])
    assert out.exit_code == 2 and "tree benchmark" in out.output
    out = CliRunner().invoke(app, ["bench", "tree", "--set", "novalue"])
    assert out.exit_code == 2 and "key=value" in out.output
