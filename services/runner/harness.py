"""Harnesses by configuration: a command template, environment templates and config
files, rendered per rollout. The base URL and the key reach the harness in environment
variables (the key never in ``argv``, where ``ps`` would show it).

Placeholders: ``{python}`` (this interpreter), ``{repo}`` (Gyre's checkout, for
``PYTHONPATH`` when Gyre is not installed), ``{workspace}``, ``{home}``, ``{prompt_file}``,
``{prompt}`` (the task text), ``{base_url}`` (``<proxy>/r/<rollout>``), ``{openai_base_url}`` (``{base_url}/v1``),
``{model}``, ``{rollout_id}``, ``{max_turns}``; in ``env`` and ``files`` also ``{api_key}``.

Every harness gets ``GYRE_BASE_URL``, ``GYRE_API_KEY``, ``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` and ``HOME``; presets add
what their client needs (shared/notes/agent-clients.md). See services/runner/README.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class HarnessConfig:
    name: str  # RolloutStarted.harness: the trajectory service picks its fork rules by it
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)  # path under {home} -> content template
    program: str | None = None  # what must be on PATH (None: always available)
    install_hint: str = ""

    def available(self) -> bool:
        return self.program is None or shutil.which(self.program) is not None

    def with_args(self, *args: str) -> HarnessConfig:
        return replace(self, command=(*self.command, *args))


@dataclass(frozen=True)
class RenderedHarness:
    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str]


def render(config: HarnessConfig, values: Mapping[str, str], api_key: str,
           base_env: Mapping[str, str] | None = None) -> RenderedHarness:
    public = {**values, "python": sys.executable, "repo": str(REPO)}
    if "{api_key}" in " ".join(config.command):
        raise ValueError(f"harness {config.name}: the API key goes in env, never in argv")
    secret = {**public, "api_key": api_key}
    env = dict(base_env if base_env is not None else _base_env())
    base_url = public["base_url"]
    env.update(GYRE_BASE_URL=base_url, GYRE_API_KEY=api_key, OPENAI_BASE_URL=public["openai_base_url"],
               OPENAI_API_KEY=api_key, ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY=api_key,
               HOME=public["home"])
    env.update({k: v.format_map(secret) for k, v in config.env.items()})
    files = {Path(public["home"]) / rel: text.format_map(secret) for rel, text in config.files.items()}
    return RenderedHarness([a.format_map(public) for a in config.command], env, files)


def _base_env() -> dict[str, str]:
    """Only what a harness needs from the runner's environment (no secrets of ours)."""
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV", "NODE_PATH")
    return {k: os.environ[k] for k in keep if k in os.environ}


def gyre_agent(api: str = "openai", *extra: str) -> HarnessConfig:
    """The reference harness (``gyre agent``, services/runner/agent)."""
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if not _gyre_installed():
        env["PYTHONPATH"] = "{repo}"  # a bare checkout: the package is importable only from there
    return HarnessConfig(
        name="gyre_agent",
        command=("{python}", "-m", "services.runner.agent", "--api", api, "--workspace", "{workspace}",
                 "--prompt-file", "{prompt_file}", "--model", "{model}", "--max-turns", "{max_turns}", *extra),
        env=env,
    )


def _gyre_installed() -> bool:
    """Gyre is installed into this interpreter (``pip install [-e] .``), so the agent imports
    without the checkout on its path. (Not a wall: the agent's shell can still read files.)"""
    try:
        importlib.metadata.distribution("gyre")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


MINI_SWE_AGENT = HarnessConfig(
    name="mini_swe_agent",
    command=("mini", "-y", "--exit-immediately", "-m", "openai/{model}", "-c", "mini.yaml",
             "-c", "{home}/gyre-mini.yaml", "-t", "{prompt}"),
    env={"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors"},
    files={"gyre-mini.yaml": "model:\n  model_kwargs:\n    api_base: {openai_base_url}\n    api_key: {api_key}\n"
                             "environment:\n  cwd: {workspace}\n"},
    program="mini", install_hint="pip install mini-swe-agent",
)

CLAUDE_CODE = HarnessConfig(
    name="claude_code",
    command=("claude", "-p", "{prompt}", "--output-format", "json", "--dangerously-skip-permissions",
             "--max-turns", "{max_turns}"),
    env={"IS_SANDBOX": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_TMPDIR": "{home}"},
    program="claude", install_hint="npm install -g @anthropic-ai/claude-code",
)

CODEX = HarnessConfig(
    name="codex",
    command=("codex", "exec", "--skip-git-repo-check", "--ephemeral", "-s", "workspace-write", "-C", "{workspace}",
             "-m", "{model}", "{prompt}"),
    env={"CODEX_HOME": "{home}/.codex", "GYRE_CODEX_KEY": "{api_key}"},
    files={".codex/config.toml": 'model_provider = "gyre"\n\n[model_providers.gyre]\nname = "gyre"\n'
                                 'base_url = "{openai_base_url}"\nenv_key = "GYRE_CODEX_KEY"\nwire_api = "responses"\n'},
    program="codex", install_hint="npm install -g @openai/codex",
)

BUILTIN_PRESETS: dict[str, HarnessConfig] = {
    "gyre_agent": gyre_agent(),
    "gyre_agent_anthropic": replace(gyre_agent("anthropic"), name="gyre_agent"),
    "mini_swe_agent": MINI_SWE_AGENT,
    "claude_code": CLAUDE_CODE,
    "codex": CODEX,
}


def presets() -> dict[str, HarnessConfig]:
    """The built-in presets plus harnesses installed as ``gyre.harnesses`` plugins."""
    from libs.common.plugins import merged

    return {k: v for k, v in merged(BUILTIN_PRESETS, "gyre.harnesses").items() if isinstance(v, HarnessConfig)}


PRESETS = presets()
