"""``gyre agent``: the reference harness. A black box to the rest of Gyre: it reads its
task, talks to a model only through the OpenAI Chat Completions or the Anthropic
Messages API, works in its workspace, and prints one JSON line of statistics at the end.

    gyre agent --api openai --workspace WS --prompt-file TASK.md [--base-url URL] [--model NAME]

The base URL and key default to ``GYRE_BASE_URL`` / ``GYRE_API_KEY`` (else the
``OPENAI_*`` or ``ANTHROPIC_*`` variables), which the rollout runner sets.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
from pathlib import Path

from .loop import AgentConfig, run_agent
from .tools import ToolLimits, Workspace, kill_commands
from .wire import HttpModelApi


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre agent", description="Gyre's reference agent harness")
    p.add_argument("--api", choices=("openai", "anthropic"), default="openai")
    p.add_argument("--workspace", type=Path, default=Path.cwd())
    task = p.add_mutually_exclusive_group(required=True)
    task.add_argument("--prompt-file", type=Path)
    task.add_argument("--prompt")
    p.add_argument("--base-url", default=None)
    p.add_argument("--model", default="policy")
    p.add_argument("--max-turns", type=int, default=40)
    p.add_argument("--max-sub-turns", type=int, default=12)
    p.add_argument("--max-calls", type=int, default=200)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--context-budget", type=int, default=6000, help="tokens of one call that trigger compaction")
    p.add_argument("--max-depth", type=int, default=1, help="sub-agent nesting (0: no Agent tool)")
    p.add_argument("--max-tokens", type=int, default=512, help="output tokens per call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: not sent, the server's 1.0)")
    p.add_argument("--run-timeout", type=float, default=30.0, help="default seconds for one command")
    p.add_argument("--http-timeout", type=float, default=300.0)
    return p


def _endpoint(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(base URL, API key). The base URL is the server's root: a trailing ``/v1`` (as
    OpenAI clients' base URLs have) is dropped, since the harness adds ``/v1/...`` itself."""
    env = os.environ
    base = args.base_url or env.get("GYRE_BASE_URL")
    if not base and args.api == "anthropic":
        base = env.get("ANTHROPIC_BASE_URL")
    if not base:
        base = env.get("OPENAI_BASE_URL")
    if base:
        base = base.strip().rstrip("/").removesuffix("/v1").rstrip("/") or None
    key = env.get("GYRE_API_KEY") or env.get("ANTHROPIC_API_KEY" if args.api == "anthropic" else "OPENAI_API_KEY")
    return base, key


def _missing(args: argparse.Namespace, base: str | None, key: str | None) -> str | None:
    """What is missing to reach the model, in the names a user sets; None: nothing."""
    vendor = "ANTHROPIC" if args.api == "anthropic" else "OPENAI"
    if not base:
        return f"no base URL (--base-url, GYRE_BASE_URL or {vendor}_BASE_URL)"
    if not key:
        return f"no API key (GYRE_API_KEY or {vendor}_API_KEY; a local server takes any non-empty key)"
    return None


def _stop_commands_with_the_agent() -> None:
    """The runner ends a rollout by signalling the agent's process group; the run tool's
    commands have groups of their own, so the agent takes them down itself."""
    atexit.register(kill_commands)
    if threading.current_thread() is not threading.main_thread():
        return  # called from a thread (embedded): signals stay the host's business

    def on_term(signum: int, _frame) -> None:
        kill_commands()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _stop_commands_with_the_agent()
    base, key = _endpoint(args)
    missing = _missing(args, base, key)
    if missing:
        print(f"gyre agent: {missing}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text(encoding="utf-8")
    config = AgentConfig(max_turns=args.max_turns, max_sub_turns=args.max_sub_turns, max_calls=args.max_calls,
                         max_retries=args.max_retries, context_budget=args.context_budget, max_depth=args.max_depth)
    api = HttpModelApi(args.api, base, key, args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                       top_p=args.top_p, timeout_s=args.http_timeout)
    workspace = Workspace(args.workspace, ToolLimits(run_timeout_s=args.run_timeout))
    try:
        _, _, status = run_agent(api, workspace, prompt, config)
    finally:
        api.close()
    return status
