"""docker-compose.yml: valid by the compose spec, every Gyre service a real `gyre serve`
command with settings the code reads, health-ordered, and runnable: the last test starts
each service's command as a local process with the file's environment and sees it healthy."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import _catalog as cat

@pytest.fixture(scope="module")
def compose() -> dict:
    return cat.load_compose()


def gyre_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if cat.serve_name(s.get("command")) is not None}


def test_compose_file_is_valid_by_the_compose_spec(compose):
    compose_spec = cat.need("compose_spec", "compose-spec")
    parsed = compose_spec.PyCompose.from_json(json.dumps(compose))
    parsed.validate()  # references to volumes, networks, configs and secrets
    assert set(parsed.service_names()) == set(compose["services"])


def test_docker_compose_config_accepts_the_file():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (Debian: apt-get install docker-compose)")
    run = subprocess.run([binary, "-f", str(cat.COMPOSE), "config", "-q"], capture_output=True, text=True,
                         cwd=cat.ROOT, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_stack_has_every_part_the_issue_asks_for(compose):
    services = compose["services"]
    names = {n: cat.serve_name(s.get("command")) for n, s in services.items()}
    for wanted in ("projector", "proxy", "scheduler", "trajectory", "trainer", "evaluator", "runner"):
        assert wanted in names.values(), f"no `gyre serve {wanted}` service"
    engines = [n for n, v in names.items() if v == "engine"]
    cells = [n for n, v in names.items() if v == "cell"]
    assert len(engines) == 2 and len(cells) == 2, (engines, cells)
    assert sum(cat.environment(services[c]).get("GYRE_CELL_CORE") == "1" for c in cells) == 1, "one core cell"
    for cell in cells:  # each agent points at its own engine, and the engine exists
        url = cat.environment(services[cell])["GYRE_CELL_ENGINE_URL"]
        host, port = url.removeprefix("http://").split(":")
        assert host in engines and cat.option(services[host]["command"], "--port") == port
    assert {"nats", "postgres"} <= set(services)


def test_every_gyre_command_is_a_known_service_on_the_container_port(compose):
    problems = []
    for name, svc in gyre_services(compose).items():
        command = svc["command"]
        why = cat.check_service_name(cat.serve_name(command))
        if why:
            problems.append(f"{name}: {why}")
        if cat.option(command, "--port") != str(cat.CONTAINER_PORT):
            problems.append(f"{name}: --port must be {cat.CONTAINER_PORT}")
        test = svc.get("healthcheck", {}).get("test")
        if test != ["CMD", "gyre-healthcheck", str(cat.CONTAINER_PORT)]:
            problems.append(f"{name}: healthcheck {test!r} does not ask /health on --port")
    assert not problems, "\n".join(problems)


def test_environment_names_are_read_by_the_code(compose):
    used = set(cat.image_env())
    for svc in gyre_services(compose).values():
        used |= set(cat.environment(svc))
    assert not cat.unknown_env(used), f"GYRE_* names nothing reads: {cat.unknown_env(used)}"


def test_start_order_follows_health(compose):
    services = compose["services"]
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec.get("condition") == "service_healthy", f"{name} -> {dep}: start after it is healthy"
    for name, svc in gyre_services(compose).items():
        deps = set(svc.get("depends_on") or {})
        uses_bus = cat.serve_name(svc["command"]) not in cat.WITHOUT_BUS
        assert ("nats" in deps) == uses_bus, f"{name}: waits for NATS if and only if it uses it"
        # a service that calls another (http://<service>:<port>) starts after it is healthy
        called = {host for value in cat.environment(svc).values()
                  for host in re.findall(r"http://([a-z0-9-]+):\d+", value) if host in services}
        assert called <= deps, f"{name} calls {sorted(called - deps)} without waiting for them"
        # the projector applies the migrations; every service on the bus waits for it
        if name != "projector" and uses_bus:
            assert "projector" in deps, f"{name}: start after the projector (migrations)"
    assert set(services["projector"]["depends_on"]) == {"nats", "postgres"}
    order = start_order(services)  # raises on a cycle
    assert order.index("projector") < order.index("proxy") < order.index("scheduler")


def test_nats_runs_jetstream_on_a_volume_with_a_config_the_server_accepts(compose, tmp_path):
    nats = compose["services"]["nats"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    assert mounts["/data/jetstream"] in compose["volumes"], "JetStream's store is a named volume"
    conf = (cat.ROOT / mounts["/etc/nats/nats.conf"]).read_text()
    assert "jetstream" in conf and "/data/jetstream" in conf
    # the server's own config check (-t), with the store moved somewhere writable
    local = tmp_path / "nats.conf"
    local.write_text(conf.replace("/data/jetstream", str(tmp_path / "js")))
    run = subprocess.run([nats_server(), "-t", "-c", str(local)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr + run.stdout


def test_the_proxy_is_published_and_nats_only_on_loopback(compose):
    published = {n for n, s in compose["services"].items() if s.get("ports")}
    assert published == {"proxy", "nats"}
    assert compose["services"]["proxy"]["ports"] == [f"127.0.0.1:8000:{cat.CONTAINER_PORT}"]
    assert all(p.startswith("127.0.0.1:") for p in compose["services"]["nats"]["ports"])


# --- the stack, as local processes ----------------------------------------------------------


def start_order(services: dict) -> list[str]:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise AssertionError(f"depends_on cycle through {name}")
        state[name] = "visiting"
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        state[name] = "done"
        order.append(name)

    for name in services:
        visit(name)
    return order


def nats_server() -> str:
    from libs.common.natsserver import find_nats_server

    return str(find_nats_server())


@pytest.fixture
def local_database(request, tmp_path) -> str:
    """A throwaway PostgreSQL database (tests/conftest.py), else SQLite."""
    try:
        return request.getfixturevalue("postgres_url")
    except pytest.skip.Exception:
        return f"sqlite:///{tmp_path / 'gyre.db'}"


@pytest.mark.slow
def test_every_compose_service_runs_locally_and_becomes_healthy(compose, nats_server, local_database, tmp_path):
    from tests.deploy._stack import LocalStack

    with LocalStack(compose, nats_url=nats_server.url, database_url=local_database, work=tmp_path) as stack:
        report = stack.run(start_order(compose["services"]))
    print(json.dumps(report, indent=1))
    assert not report["failed"], report["failed"]
    runnable = {n for n, s in gyre_services(compose).items()
                if cat.serve_name(s["command"]) in cat.registered_services()}
    assert set(report["healthy"]) == runnable
    assert set(report["pending"]) == set(gyre_services(compose)) - runnable
    assert report["stopped_cleanly"] == sorted(runnable)


def test_healthcheck_script_reports_an_unreachable_service(tmp_path):
    from libs.common.natsserver import free_port

    run = subprocess.run([sys.executable, str(cat.HEALTHCHECK), str(free_port())], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 1 and "/health" in run.stderr


def test_bind_mounts_exist_and_the_evaluator_gets_its_tasks(compose):
    tasks_dir = cat.image_env()["GYRE_EVALUATOR_TASKS_DIR"]
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes") or []:
            source, target = volume.split(":")[:2]
            if source.startswith("./") and target != tasks_dir:  # docker creates a missing ./tasks
                assert (cat.ROOT / source).exists(), f"{name}: {source}"
    assert f"./tasks:{tasks_dir}:ro" in compose["services"]["evaluator"]["volumes"]
    assert Path(cat.HEALTHCHECK).exists()


def test_the_core_trainer_is_wired_as_gyre_up_wires_it(compose):
    """gyre/up.py: GYRE_TRAINER_ROLE=core, GYRE_TRAINER_CELL the core cell, GYRE_MODEL the
    policy, GYRE_TRAINER_PUBLISH_TO every cell's engine (cell=url), groups per step set."""
    services = compose["services"]
    env = cat.environment(services["trainer"])
    cells = {cat.environment(s)["GYRE_CELL_NAME"]: cat.environment(s) for s in services.values()
             if cat.serve_name(s.get("command")) == "cell"}
    core = [name for name, e in cells.items() if e.get("GYRE_CELL_CORE") == "1"]
    assert env["GYRE_TRAINER_ROLE"] == "core" and [env["GYRE_TRAINER_CELL"]] == core
    assert int(env["GYRE_TRAINER_GROUPS_PER_STEP"]) >= 1  # without it the core never closes a step
    # as gyre up: the scheduler waits for as many groups before it pulls the core in for an update
    assert cat.environment(services["scheduler"])["GYRE_SCHEDULER_GROUPS_PER_STEP"] == env["GYRE_TRAINER_GROUPS_PER_STEP"]
    models = {env["GYRE_MODEL"], cat.environment(services["trajectory"])["GYRE_MODEL"],
              cat.environment(services["proxy"])["GYRE_MODEL"]}
    models |= {e["GYRE_MODEL"] for e in cells.values()}
    models |= {cat.environment(s)["GYRE_ENGINE_MODEL"] for s in services.values()
               if cat.serve_name(s.get("command")) == "engine"}
    assert models == {"tiny-qwen"}, "one policy everywhere"
    targets = dict(item.split("=", 1) for item in env["GYRE_TRAINER_PUBLISH_TO"].split(","))
    assert targets == {name: e["GYRE_CELL_ENGINE_URL"] for name, e in cells.items()}
    # separate containers share no /dev/shm: weights go as folders on the trainer's volume,
    # which every engine mounts at the same path
    assert env["GYRE_TRAINER_PUBLISH_MODE"] == "disk"
    state = next(v for v in services["trainer"]["volumes"] if v.endswith(":/var/lib/gyre"))
    for url in targets.values():
        engine = url.removeprefix("http://").split(":")[0]
        assert f"{state}:ro" in services[engine]["volumes"], engine
        assert cat.environment(services[engine])["GYRE_ENGINE_ADMIN_TOKEN"]
