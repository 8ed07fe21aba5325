"""What the deployment files may name, read from the code: the `gyre serve` services and the
GYRE_* environment variables that settings classes and services read.

A name the code does not know yet must be listed in PENDING_SERVICES / PENDING_ENV below
(with the issue that brings it); anything else is a typo or drift, and the tests fail.
"""

from __future__ import annotations

import importlib
import inspect
import re
from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "deploy" / "helm" / "gyre"
SYSTEMD = ROOT / "deploy" / "systemd"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
CONTAINER_PORT = 8080  # every Gyre container serves /health and /metrics here

# Services the deployment starts whose `gyre serve` name is not registered yet (`gyre serve
# --list`); each leaves this list when its issue lands.
PENDING_SERVICES: dict[str, str] = {}  # none today: every service the files start is registered

# What a service does not do that the others do (so the tests expect it).
WITHOUT_BUS = {"engine"}  # the embedded engine serves SGLang's API and never opens NATS
WITHOUT_METRICS: set[str] = set()  # every service serves /metrics (the engine on its SGLang port)

# Variables the deployment sets that no code reads yet, proposed names (docs/deploy.md,
# "Settings": the PP/CP/EP sizes).
PENDING_ENV = {
    "GYRE_TRAINER_PIPELINE_MODEL_PARALLEL_SIZE": "trainer: megatron pipeline-parallel size",
    "GYRE_TRAINER_CONTEXT_PARALLEL_SIZE": "trainer: megatron context-parallel size",
    "GYRE_TRAINER_EXPERT_MODEL_PARALLEL_SIZE": "trainer: megatron expert-parallel size",
}

# A whole quoted literal such as "GYRE_PROXY_URL" (not a prefix such as "GYRE_ENGINE_").
_ENV_READ = re.compile(r"""["'](GYRE_[A-Z0-9_]*[A-Z0-9])["']""")
_ENV_PREFIX = re.compile(r"""env_prefix\s*=\s*["'](GYRE_[A-Z0-9_]*)["']""")


def need(module: str, package: str):
    """Import a validator from requirements/deploy.txt; without it the test is skipped, unless
    GYRE_TEST_REQUIRE_DEPLOY_TOOLS=1 (then a missing validator fails the run)."""
    import os

    import pytest

    if os.environ.get("GYRE_TEST_REQUIRE_DEPLOY_TOOLS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{package} not installed: pip install -r requirements/deploy.txt")


@lru_cache(maxsize=1)
def registered_services() -> frozenset[str]:
    """The names `gyre serve --list` prints: what the CLI can start."""
    from typer.testing import CliRunner

    from gyre.cli import app

    result = CliRunner().invoke(app, ["serve", "--list"])
    assert result.exit_code == 0, result.output
    return frozenset(line.split()[0] for line in result.output.splitlines() if line.strip())


def check_service_name(name: str) -> str | None:
    """None if `gyre serve <name>` is registered or pending, else why not."""
    if name in registered_services() or name in PENDING_SERVICES:
        return None
    return (f"`gyre serve {name}`: not in gyre/services.py ({', '.join(sorted(registered_services()))}) "
            f"nor pending ({', '.join(sorted(PENDING_SERVICES))})")


def _source_files() -> list[Path]:
    return [p for d in ("gyre", "libs", "services") for p in (ROOT / d).rglob("*.py")]


def _settings_variables(cls: type, prefix: str) -> set[str]:
    from pydantic import BaseModel

    names: set[str] = set()
    delimiter = cls.model_config.get("env_nested_delimiter") or ""
    for field, info in cls.model_fields.items():
        names.add(prefix + field.upper())
        nested = [a for a in (info.annotation, *getattr(info.annotation, "__args__", ()))
                  if inspect.isclass(a) and issubclass(a, BaseModel)]
        for model in nested if delimiter else []:
            names |= {f"{prefix}{field.upper()}{delimiter}{sub.upper()}" for sub in model.model_fields}
    return names


@lru_cache(maxsize=1)
def known_env() -> frozenset[str]:
    """GYRE_* names the code reads: fields of every settings class with a GYRE_ prefix (found
    by their env_prefix, so a new service's settings count as soon as they land) and names a
    module reads from os.environ directly."""
    from pydantic_settings import BaseSettings

    names: set[str] = set()
    for path in _source_files():
        text = path.read_text(encoding="utf-8")
        names |= set(_ENV_READ.findall(text))
        if not _ENV_PREFIX.search(text):
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseSettings) and cls.__module__ == module.__name__:
                prefix = cls.model_config.get("env_prefix", "")
                if prefix.startswith("GYRE_"):
                    names |= _settings_variables(cls, prefix)
    return frozenset(names)


def unknown_env(names) -> list[str]:
    """The GYRE_* names among ``names`` that are neither read by the code nor pending."""
    known = known_env()
    return sorted(n for n in set(names) if n.startswith("GYRE_") and n not in known and n not in PENDING_ENV)


# --- compose -------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: ${NAME}, ${NAME:-default}, ${NAME-default}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _INTERPOLATION.sub(one, value)


def load_compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml with YAML anchors and merge keys resolved and variables substituted
    (by default with the file's own defaults, as with an empty environment)."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def serve_name(command) -> str | None:
    """``gyre serve <name> ...`` -> name; None for a command that is not one."""
    if isinstance(command, str):
        command = command.split()
    if command and len(command) >= 3 and command[0] == "gyre" and command[1] == "serve":
        return command[2]
    return None


def option(command: list[str], flag: str) -> str | None:
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


# --- Dockerfile ----------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per stage name: {stage: [(INSTRUCTION, arguments), ...]} (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            current = m.group(1) if m else rest
            stages[current] = []
        stages[current].append((word, rest.strip()))
    return stages


def image_env(stage: str = "runtime") -> dict[str, str]:
    """The ENV the runtime image sets (KEY=value pairs)."""
    env: dict[str, str] = {}
    for word, rest in dockerfile_stages()[stage]:
        if word == "ENV":
            for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S*)', rest):
                env[key] = value.strip('"')
    return env
