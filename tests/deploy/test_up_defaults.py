"""The deployments run the services with `gyre up`'s defaults where the services' own
defaults differ (docs/deploy.md, "Settings"), and the service options that `gyre serve` takes
only from the environment are read, with errors that name the variable."""

from __future__ import annotations

import re

import pytest

from libs.common.runconfig import RunConfig
from tests.deploy import _catalog as cat

RUN = RunConfig()
# variable -> (gyre up's value, the service's own default), for each option where they differ
UP_DEFAULTS = {
    "trainer": {"GYRE_TRAINER_TIS_CAP": RUN.loss.tis_cap, "GYRE_TRAINER_MAX_STALENESS": RUN.trainer.staleness},
    "trajectory": {"GYRE_TRAJECTORY_MICRO_STEP_TOKENS": RUN.trainer.micro_step_tokens},
    "runner": {"GYRE_RUNNER_MAX_TURNS": RUN.harness.max_turns},
}
UP_DEFAULTS["cell"] = UP_DEFAULTS["trainer"]  # a cell's satellite seat trains as the core does


def _check(service: str, env: dict[str, str], label: str = "") -> list[str]:
    return [f"{label or service}: {name}={env.get(name)!r}, gyre up gives {want!r}"
            for name, want in UP_DEFAULTS[service].items()
            if env.get(name) is None or float(env[name]) != float(want)]


def test_gyre_up_defaults_differ_from_the_services_own():
    """Why the deployments must set them: unset, each service falls back to another value."""
    from services.runner.main import runner_config
    from services.trainer.main import train_config, worker_settings
    from services.trajectory.main import ledger_config

    assert train_config({}).objective.tis_cap is None != RUN.loss.tis_cap
    assert worker_settings("r", "c", {}).max_staleness is None != RUN.trainer.staleness
    assert ledger_config("r", {}).micro_step_tokens != RUN.trainer.micro_step_tokens
    assert runner_config("r", {"proxy_url": "http://p:1", "work_root": "/tmp/x"}).max_turns != RUN.harness.max_turns


def test_compose_sets_gyre_up_defaults():
    services = cat.load_compose()["services"]
    problems = []
    for name, svc in services.items():
        serve = cat.serve_name(svc.get("command") or [])
        if serve in UP_DEFAULTS:
            problems += _check(serve, cat.environment(svc), name)
    assert not problems, problems


def test_systemd_examples_set_gyre_up_defaults():
    def example(name: str) -> dict[str, str]:
        lines = (cat.SYSTEMD / name).read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_][A-Z0-9_]*=", line))

    problems = (_check("trainer", example("trainer.env.example")) + _check("cell", example("cell.env.example"))
                + _check("trajectory", example("trajectory.env.example")) + _check("runner", example("runner.env.example")))
    assert not problems, problems


def test_helm_sets_gyre_up_defaults_and_gives_the_cells_the_trainers_objective():
    cat.need("helm_python", "helm-python-sdk")
    from tests.deploy.test_helm import containers, render

    def envs(values):
        out = {}
        for doc in render(values):
            for c in containers(doc):
                serve = cat.serve_name(c.get("args") or [])
                if serve:
                    out.setdefault(serve, []).append({e["name"]: e.get("value") for e in c.get("env", [])})
        return out

    problems = [p for serve, found in envs(None).items() if serve in UP_DEFAULTS for env in found
                for p in _check(serve, env)]
    assert not problems, problems
    # an objective option set on the trainer reaches every cell's satellite seat; cells.env wins
    changed = envs({"services": {"trainer": {"env": {"GYRE_TRAINER_LR": "3e-6", "GYRE_TRAINER_TIS_CAP": "5"}}},
                    "cells": {"env": {"GYRE_TRAINER_LR": "1e-6"}}})
    assert len(changed["cell"]) == 2
    for env in changed["cell"]:
        assert (env["GYRE_TRAINER_TIS_CAP"], env["GYRE_TRAINER_LR"]) == ("5", "1e-6")


def test_helm_mounts_the_models_claim_in_the_embedded_engine():
    cat.need("helm_python", "helm-python-sdk")
    from tests.deploy.test_helm import containers, render

    engines = [c for doc in render({"cells": {"modelsClaim": "models"}}) for c in containers(doc)
               if cat.serve_name(c.get("args") or []) == "engine"]
    assert len(engines) == 2
    for c in engines:
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_trajectory_variables_are_the_names_gyre_up_sets():
    from services.trajectory.main import ENV, env_options

    assert ENV == {name: f"GYRE_TRAJECTORY_{name.upper()}" for name in ENV}  # gyre/up.py's names
    assert env_options({}, {"GYRE_TRAJECTORY_MICRO_STEP_TOKENS": "8192"}) == {"micro_step_tokens": "8192"}


def test_trainer_takes_max_grad_norm_from_the_environment():
    from services.trainer.main import env_options, train_config

    assert train_config({}).max_grad_norm == 1.0
    assert train_config(env_options({}, {"GYRE_TRAINER_MAX_GRAD_NORM": "0.5"})).max_grad_norm == 0.5
    assert train_config(env_options({}, {"GYRE_TRAINER_MAX_GRAD_NORM": "0"})).max_grad_norm == 0  # no clipping
    for bad in ("big", "-1", "inf"):
        with pytest.raises(ValueError, match="GYRE_TRAINER_MAX_GRAD_NORM"):
            train_config(env_options({}, {"GYRE_TRAINER_MAX_GRAD_NORM": bad}))


def test_trainer_takes_attention_from_the_environment():
    from services.trainer.main import env_options, train_config

    assert train_config({}).attention.mode == "auto"
    assert train_config(env_options({}, {"GYRE_TRAINER_ATTENTION": "blocks"})).attention.mode == "blocks"
    with pytest.raises(ValueError, match="GYRE_TRAINER_ATTENTION"):
        train_config(env_options({}, {"GYRE_TRAINER_ATTENTION": "sparse"}))
