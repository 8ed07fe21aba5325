"""deploy/systemd: `systemd-analyze verify` on every unit (where the tool exists), each Gyre
unit runs a known `gyre serve` service with the required settings and hardening, the
example environment files name variables the code reads, and the NATS config passes the
server's own check."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy import _catalog as cat

UNITS = sorted(cat.SYSTEMD.glob("*.service")) + sorted(cat.SYSTEMD.glob("*.target"))
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes"}


def parse(unit: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def one(unit: dict, section: str, key: str) -> str | None:
    values = unit.get(section, {}).get(key)
    return values[-1] if values else None


def test_units_pass_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed")
    # A root with the system's own units and stand-ins for the programs the units start
    # (they live on the target hosts: /opt/gyre/venv, nats-server), so that verify checks
    # the units themselves and not this machine's install.
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(unit, units / unit.name)
        for key in ("ExecStart", "ExecStop", "ExecReload", "ExecStartPre"):
            for command in parse(unit).get("Service", {}).get(key, []):
                program = root / command.lstrip("-@:+!").split()[0].lstrip("/")
                program.parent.mkdir(parents=True, exist_ok=True)
                program.write_text("#!/bin/sh\n")
                program.chmod(0o755)
    run = subprocess.run([tool, "verify", f"--root={root}", "--man=no", *[str(units / u.name) for u in UNITS]],
                         capture_output=True, text=True, timeout=60)
    # verify prints warnings (unknown keys, bad values) without failing: any output fails here
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


@pytest.mark.parametrize("unit", [u for u in UNITS if u.suffix == ".service"], ids=lambda u: u.name)
def test_unit_has_environment_file_restart_and_hardening(unit):
    parsed = parse(unit)
    service = parsed["Service"]
    assert service.get("EnvironmentFile"), "EnvironmentFile="
    assert one(parsed, "Service", "Restart") == "on-failure"
    for key, value in HARDENING.items():
        assert one(parsed, "Service", key) == value, f"{key}={value}"
    assert one(parsed, "Install", "WantedBy") in ("gyre.target", "multi-user.target")


@pytest.mark.parametrize("unit", sorted(cat.SYSTEMD.glob("gyre-*.service")), ids=lambda u: u.name)
def test_gyre_units_run_known_services(unit):
    parsed = parse(unit)
    command = one(parsed, "Service", "ExecStart").split()
    if unit.name == "gyre-nats.service":
        assert command[0].endswith("nats-server")
        return
    if command[1:3] == ["-m", "sglang.launch_server"]:  # a GPU cell's SGLang server
        from services.engine.sglang_server import SGLangConfig, build_command

        launcher = build_command(SGLangConfig(model_path="m", admin_api_key="k"))
        assert {a for a in command if a.startswith("--")} <= set(launcher), "flags Gyre's launcher does not use"
        return
    assert command[0] == "/opt/gyre/venv/bin/gyre"
    name = cat.serve_name(["gyre", *command[1:]])
    assert name is not None and not cat.check_service_name(name), cat.check_service_name(name or "?")
    assert cat.option(command, "--port"), "--port for /health and /metrics"
    assert one(parsed, "Service", "User") in ("gyre", "root")
    if one(parsed, "Service", "User") == "root":  # only the evaluator, for its sandbox
        assert name == "evaluator"
        assert one(parsed, "Service", "CapabilityBoundingSet"), "root with a bounded capability set"


def test_every_service_has_a_unit():
    names = set()
    for unit in cat.SYSTEMD.glob("gyre-*.service"):
        command = one(parse(unit), "Service", "ExecStart").split()
        if command[0].endswith("/gyre"):
            names.add(command[2])
    assert {"projector", "proxy", "scheduler", "trajectory", "trainer", "evaluator", "runner", "engine",
            "cell"} <= names


def env_files() -> list[Path]:
    return sorted(cat.SYSTEMD.glob("*.env.example"))


def test_example_environment_files_name_variables_the_code_reads():
    used = set()
    for path in env_files():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                used.add(line.split("=", 1)[0])
    for unit in cat.SYSTEMD.glob("*.service"):
        for value in parse(unit).get("Service", {}).get("Environment", []):
            used |= set(re.findall(r"(?:^|\s)([A-Z_][A-Z0-9_]*)=", value))
    assert not cat.unknown_env(used), f"GYRE_* names nothing reads: {cat.unknown_env(used)}"
    assert {"GYRE_NATS_URL", "GYRE_DATABASE_URL", "GYRE_ADMIN_TOKEN", "GYRE_STREAM_REPLICAS"} <= used


def test_variables_a_unit_expands_are_set_by_its_example_files():
    for unit in cat.SYSTEMD.glob("*.service"):
        parsed = parse(unit)
        examples = ""
        for path in parsed["Service"]["EnvironmentFile"]:
            stem = Path(path.lstrip("-")).name.replace("-%i", "")  # engine-%i.env -> engine.env
            example = cat.SYSTEMD / f"{stem}.example"
            assert example.exists() or path.startswith("-"), f"{unit.name}: no {example.name}"
            examples += example.read_text() if example.exists() else ""
        examples += "\n".join(parsed["Service"].get("Environment", []))
        for command in parsed["Service"].get("ExecStart", []):
            used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", command)) - {"MAINPID"}
            missing = [v for v in sorted(used) if not re.search(rf"(^|\s){v}=", examples, re.MULTILINE)]
            assert not missing, f"{unit.name} expands {missing}, which its example files do not set"


def test_nats_config_passes_the_servers_check(tmp_path):
    from tests.deploy.test_compose import nats_server

    env = {"PATH": "/usr/bin:/bin"}
    for line in (cat.SYSTEMD / "nats.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    conf = (cat.SYSTEMD / "nats-server.conf").read_text().replace("/var/lib/nats", str(tmp_path))
    assert "jetstream" in conf and "cluster" in conf
    local = tmp_path / "nats-server.conf"
    local.write_text(conf)
    run = subprocess.run([nats_server(), "-t", "-c", str(local)], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 0, run.stderr + run.stdout


def test_install_guide_names_every_file():
    guide = (cat.SYSTEMD / "INSTALL.md").read_text()
    for path in cat.SYSTEMD.iterdir():
        if path.name != "INSTALL.md":
            assert path.name in guide, f"INSTALL.md does not mention {path.name}"



def example(name: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (cat.SYSTEMD / name).read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def test_the_guide_starts_the_core_trainer_wired_as_gyre_up_wires_it():
    guide = (cat.SYSTEMD / "INSTALL.md").read_text()
    enabled = " ".join(line for line in guide.splitlines() if "systemctl enable --now" in line)
    assert "gyre-trainer" in enabled.split(), "no host enables the trainer: no update is ever applied"
    trainer = example("trainer.env.example")
    assert trainer["GYRE_TRAINER_ROLE"] == "core"
    assert int(trainer["GYRE_TRAINER_GROUPS_PER_STEP"]) >= 1  # without it the core never closes a step
    # as gyre up: the scheduler waits for as many groups before it pulls the core in for an update
    assert example("scheduler.env.example")["GYRE_SCHEDULER_GROUPS_PER_STEP"] == trainer["GYRE_TRAINER_GROUPS_PER_STEP"]
    assert all("=http://" in item for item in trainer["GYRE_TRAINER_PUBLISH_TO"].split(","))
    cell = example("cell.env.example")
    assert cell["GYRE_CELL_CORE"] == "1"
    assert trainer["GYRE_TRAINER_BACKEND"] == cell["GYRE_TRAINER_BACKEND"]  # satellites compute as the core
    # one policy everywhere (a service without GYRE_MODEL falls back to tiny-qwen)
    models = {trainer["GYRE_MODEL"], cell["GYRE_MODEL"], example("proxy.env.example")["GYRE_MODEL"],
              example("trajectory.env.example")["GYRE_MODEL"], example("engine.env.example")["GYRE_ENGINE_MODEL"],
              example("sglang.env.example")["SGLANG_MODEL_PATH"]}
    assert len(models) == 1, models
    # the second cell of the guide (cpu-0) must not be a second core cell
    assert re.search(r"sed -i '/\^GYRE_CELL_CORE=/d' /etc/gyre/cell-cpu-0.env", guide)


def test_the_embedded_engine_gets_its_own_admin_token():
    """The engine reads GYRE_ENGINE_ADMIN_TOKEN only; gyre.env binds 0.0.0.0."""
    assert example("gyre.env.example")["GYRE_HOST"] == "0.0.0.0"
    assert example("engine.env.example")["GYRE_ENGINE_ADMIN_TOKEN"] == example("gyre.env.example")["GYRE_ADMIN_TOKEN"]
