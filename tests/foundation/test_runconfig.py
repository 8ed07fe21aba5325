"""Run config: validation errors name the key, overrides, shipped examples validate."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.common.runconfig import RunConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["embedded.yaml", "cluster-gpu.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    cfg = load_run_config(ROOT / "configs" / name)
    assert cfg.run.steps >= 1 and len(cfg.digest()) == 64


def test_overrides_are_yaml_values_on_dotted_keys(tmp_path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("run: {id: a, steps: 2}\ntrainer: {lr: 1.0e-5}\n")
    cfg = load_run_config(f, ["trainer.lr=1e-6", "cells.policy=colocate", "tasks.split=heldout"])
    assert (cfg.trainer.lr, cfg.cells.policy, cfg.tasks.split, cfg.run.id) == (1e-6, "colocate", "heldout", "a")


@pytest.mark.parametrize(
    ("text", "overrides", "words"),
    [
        ("run: {steps: 0}\n", [], ["run.steps", "greater than or equal to 1"]),
        ("trainer: {lrr: 1}\n", [], ["trainer.lrr", "Extra inputs"]),
        ("cells: {policy: magic}\n", [], ["cells.policy", "elastic"]),
        ("- a list\n", [], ["top level must be a mapping"]),
        ("run: [unclosed\n", [], ["not valid YAML"]),
        ("", ["no_equals_sign"], ["expected key.path=value"]),
        ("run: {id: x}\n", ["run.id.deeper=1"], ["'id' is not a section"]),
        ("trainer: {keep_weights: 1}\n", [], ["keep_weights", "at least 2"]),
    ],
)
def test_errors_say_which_key_and_what_was_expected(tmp_path, text, overrides, words) -> None:
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(RunConfigError) as exc:
        load_run_config(f, overrides)
    for w in words:
        assert w in str(exc.value)


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(RunConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_keep_weights_takes_a_count_or_all(tmp_path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("trainer: {keep_weights: 4}\n")
    assert load_run_config(f).trainer.keep_weights == 4
    assert load_run_config(f, ["trainer.keep_weights=all"]).trainer.keep_weights == "all"
    assert load_run_config(tmp_path / "run.yaml", ["trainer.keep_weights=null"]).trainer.keep_weights is None
