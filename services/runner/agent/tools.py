"""The agent's tools, with limits on what they read, write and run. Each returns
(text, is_error); none raises on bad input from the model.

``list_files``, ``read_file`` and ``write_file`` take paths inside the workspace only.
``run`` is a plain ``/bin/sh`` in the workspace, with this process's user and rights: it
can read and write anything they can (see services/runner/README.md, "Isolation").
Each command gets a process group of its own (so its timeout kills its children too);
``kill_commands`` kills every group started, and ``main`` calls it on SIGTERM and at exit,
so nothing a command left running outlives the agent. A command that leaves its group
(``setsid``) escapes that; only running the harness under a uid of its own stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .wire import ToolSpec

_STR = {"type": "string"}


@dataclass(frozen=True)
class ToolLimits:
    read_chars: int = 12_000
    write_bytes: int = 1_000_000
    output_chars: int = 6_000
    run_timeout_s: float = 30.0
    max_run_timeout_s: float = 120.0
    list_entries: int = 300


SPECS = {
    "list_files": ToolSpec("list_files", "List files under a folder of the workspace (recursive).",
                           {"type": "object", "properties": {"path": _STR}}),
    "read_file": ToolSpec("read_file", "Read a text file of the workspace.",
                          {"type": "object", "properties": {"path": _STR}, "required": ["path"]}),
    "write_file": ToolSpec("write_file", "Create or overwrite a file of the workspace with the given content.",
                           {"type": "object", "properties": {"path": _STR, "content": _STR},
                            "required": ["path", "content"]}),
    "run": ToolSpec("run", "Run a shell command in the workspace (e.g. python -m pytest -q) and get its output.",
                    {"type": "object", "properties": {"command": _STR, "timeout_s": {"type": "number"}},
                     "required": ["command"]}),
}
AGENT_SPEC = ToolSpec("Agent", "Start a sub-agent for a self-contained sub-task; it works in the same workspace "
                               "and returns its final report.",
                      {"type": "object", "properties": {"description": _STR, "prompt": _STR},
                       "required": ["prompt"]})
# names a model may use for the same tools (other harnesses' conventions)
ALIASES = {"bash": "run", "Bash": "run", "shell": "run", "Read": "read_file", "Write": "write_file",
           "ls": "list_files", "LS": "list_files", "Task": "Agent"}
_ARG_ALIASES = {"file_path": "path", "filename": "path", "cmd": "command", "text": "content"}


class Workspace:
    def __init__(self, root: Path, limits: ToolLimits = ToolLimits()) -> None:
        self.root = root.resolve()
        self.limits = limits
        self.handlers: dict[str, Callable[[dict[str, Any]], str]] = {
            "list_files": self.list_files, "read_file": self.read_file, "write_file": self.write_file,
            "run": self.run}

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        name = ALIASES.get(name, name)
        handler = self.handlers.get(name)
        if handler is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.handlers))}", True
        args = {_ARG_ALIASES.get(k, k): v for k, v in arguments.items()}
        try:
            return handler(args), False
        except ToolError as exc:
            return f"error: {exc}", True
        except OSError as exc:
            return f"error: {exc.strerror or exc}", True

    def _path(self, value: Any, default: str | None = None) -> Path:
        if value is None and default is not None:
            value = default
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise ToolError("'path' must be a non-empty string")
        path = (self.root / value).resolve()
        if path != self.root and not path.is_relative_to(self.root):
            raise ToolError(f"{value!r} is outside the workspace")
        return path

    def list_files(self, args: dict[str, Any]) -> str:
        base = self._path(args.get("path"), ".")
        if not base.is_dir():
            raise ToolError(f"{args.get('path')!r} is not a folder")
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for f in sorted(filenames):
                out.append((Path(dirpath) / f).relative_to(self.root).as_posix())
                if len(out) >= self.limits.list_entries:
                    return "\n".join(out + ["... (more files not shown)"])
        return "\n".join(out) or "(no files)"

    def read_file(self, args: dict[str, Any]) -> str:
        path = self._path(args.get("path"))
        if not path.is_file():
            raise ToolError(f"no file {args.get('path')!r}")
        text = path.read_bytes()[: self.limits.read_chars * 4].decode("utf-8", "replace")
        if len(text) > self.limits.read_chars:
            return text[: self.limits.read_chars] + "\n... (truncated)"
        return text

    def write_file(self, args: dict[str, Any]) -> str:
        path = self._path(args.get("path"))
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolError("'content' must be a string")
        data = content.encode("utf-8")
        if len(data) > self.limits.write_bytes:
            raise ToolError(f"content over {self.limits.write_bytes} bytes")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return f"wrote {len(data)} bytes to {path.relative_to(self.root).as_posix()}"

    def run(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolError("'command' must be a non-empty string")
        timeout = _number(args.get("timeout_s"), self.limits.run_timeout_s)
        timeout = min(max(1.0, timeout), self.limits.max_run_timeout_s)
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=self.root, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        _command_groups.add(proc.pid)  # background jobs it leaves live on until the agent ends
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            exited = proc.poll()
            _kill_group(proc.pid)
            out = _drain(proc)
            if exited is None:
                status = f"killed after {timeout:g} s"
            else:  # the shell was done; something it left (e.g. ``setsid cmd &``) held its output open
                status = (f"exit status {exited} (output cut after {timeout:g} s: a background process "
                          "still holds it open)")
        return f"{status}\n{_clip(out.decode('utf-8', 'replace'), self.limits.output_chars)}"


class ToolError(ValueError):
    pass


_command_groups: set[int] = set()  # process groups of the run tool's commands, this process's lifetime


def kill_commands() -> None:
    """SIGKILL every process group ``run`` started (safe to call from a signal handler)."""
    for pgid in list(_command_groups):
        _kill_group(pgid)
        _command_groups.discard(pgid)


_DRAIN_S = 1.0  # after a kill, how long to wait for the output's end


def _drain(proc: subprocess.Popen) -> bytes:
    """What is left of a killed command's output. A process outside its group (``setsid``)
    may keep the pipe open; then what was read so far is returned and the pipe closed, so
    the tool keeps its timeout."""
    try:
        out, _ = proc.communicate(timeout=_DRAIN_S)
        return out or b""
    except subprocess.TimeoutExpired as exc:
        out = exc.output or b""  # everything read so far, both communicate calls together
    if proc.stdout is not None:
        proc.stdout.close()
    try:
        proc.wait(timeout=_DRAIN_S)
    except subprocess.TimeoutExpired:
        pass  # its group was killed; kill_commands tries again at the agent's exit
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _number(value: Any, default: float) -> float:
    try:
        return float(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + f"\n... ({len(text) - limit} characters cut) ...\n" + text[-half:]
