"""Dockerfile and .dockerignore, without a Docker engine: parsed by BuildKit's own parser
(the `dockerfile` package), checked for the stages, user, health check and install steps
the deployment relies on, and the package its build stage installs is built here from
exactly the files the build context would hold."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy import _catalog as cat

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


@pytest.fixture(scope="module")
def stages() -> dict[str, list]:
    dockerfile = cat.need("dockerfile", "dockerfile")
    result: dict[str, list] = {"": []}
    current = ""
    for command in dockerfile.parse_file(str(cat.DOCKERFILE)):
        if command.cmd == "FROM":
            current = command.value[2] if len(command.value) == 3 and command.value[1].upper() == "AS" else ""
            result[current] = []
        result[current].append(command)
    return result


def values(commands, cmd: str) -> list[tuple[str, ...]]:
    return [c.value for c in commands if c.cmd == cmd]


def test_only_known_instructions(stages):
    unknown = {c.cmd for commands in stages.values() for c in commands} - INSTRUCTIONS
    assert not unknown, unknown


def test_cpu_and_cuda_variants_by_build_argument(stages):
    args = dict(v[0].split("=", 1) for v in values(stages[""], "ARG") if "=" in v[0])
    assert args["VARIANT"] == "cpu"
    assert {"base-cpu", "base-cuda", "build", "runtime"} <= set(stages)
    for stage in ("build", "runtime"):
        assert stages[stage][0].value[0] == "base-${VARIANT}"
    build = " ".join(v[0] for v in values(stages["build"], "RUN"))
    assert 'if [ "$VARIANT" = "cuda" ]' in build and "sglang==" in build and "megatron-core==" in build


def test_installs_from_the_requirements_like_the_makefile(stages):
    build = [v[0] for v in values(stages["build"], "RUN")]
    makefile = (cat.ROOT / "Makefile").read_text()
    for flags, target in re.findall(r"pip install --quiet ((?:--\S+ )*)-r (\S+)", makefile):
        wanted = f"pip install {flags}-r {target}".replace("  ", " ")
        assert any(wanted in line for line in build), f"Dockerfile lacks `{wanted}` (Makefile installs it)"
    copied = [v for v in values(stages["build"], "COPY")]
    assert ("requirements.txt", "./") in copied and ("requirements", "./requirements") in copied


def test_runtime_is_non_root_with_a_health_check(stages):
    runtime = stages["runtime"]
    user = values(runtime, "USER")[-1][0]
    assert user.split(":")[0] not in ("0", "root"), user
    healthcheck = [c for c in runtime if c.cmd == "HEALTHCHECK"][-1]
    assert "gyre-healthcheck" in " ".join(healthcheck.value)
    assert values(runtime, "ENTRYPOINT")[-1][0] == "tini"
    assert values(runtime, "EXPOSE")[-1] == (str(cat.CONTAINER_PORT),)


def test_image_environment_matches_the_official_parse(stages):
    env = {}
    for v in values(stages["runtime"], "ENV"):
        env.update(dict(zip(v[::2], v[1::2])))
    assert env == cat.image_env()  # the light parser the compose test uses agrees
    assert not cat.unknown_env(env)
    created = " ".join(v[0] for v in values(stages["runtime"], "RUN"))
    assert env["GYRE_EVALUATOR_TASKS_DIR"] in created, "the mount point of the task set exists in the image"


def _pattern(pattern: str) -> str:
    """A .dockerignore pattern as a regex: `*` within one path element, `**` across them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return out


def dockerignore_allows(path: str) -> bool:
    """.dockerignore's rule, as Docker applies it: the last pattern that matches decides."""
    allowed = True
    for line in (cat.ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        regex = _pattern(pattern)
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            allowed = negate
    return allowed


def context_files() -> list[str]:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=cat.ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if (cat.ROOT / f).is_file() and dockerignore_allows(f)]


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else(stages):
    context = context_files()
    for stage in ("build", "runtime"):
        for command in stages[stage]:
            if command.cmd != "COPY" or any(f.startswith("--from") for f in command.flags):
                continue
            source = command.value[0]
            assert any(f == source or f.startswith(source.rstrip("/") + "/") for f in context), \
                f"COPY {source}: not in the build context"
    assert not [f for f in context if f.startswith(("tests/", ".git", ".venv", "docs/"))]
    assert not dockerignore_allows("services/engine/__pycache__/x.pyc")


def test_the_package_the_image_installs_holds_every_module(tmp_path):
    """`pip install --no-deps .` in the build stage, from the files the context holds."""
    src = tmp_path / "src"
    for f in context_files():
        if f.startswith(("gyre/", "libs/", "services/")) or f in ("pyproject.toml", "README.md"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(cat.ROOT / f, src / f)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("gyre-*.whl")))
    names = set(wheel.namelist())
    modules = [str(p.relative_to(src)) for d in ("gyre", "libs", "services") for p in (src / d).rglob("*.py")]
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules the image would lack (a folder without __init__.py?): {missing[:10]}"
    assert {"libs/common/db/migrations/env.py", "libs/common/db/migrations/script.py.mako"} <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gyre = gyre.cli:main" in wheel.read(entry_points).decode()


def test_healthcheck_script_is_in_the_context_and_uses_only_the_standard_library():
    assert dockerignore_allows("deploy/docker/healthcheck.py")
    imports = re.findall(r"^(?:import|from) (\S+)", Path(cat.HEALTHCHECK).read_text(), re.MULTILINE)
    assert set(imports) <= {"__future__", "sys", "urllib.error", "urllib.request"}, imports
