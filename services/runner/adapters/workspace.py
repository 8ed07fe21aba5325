"""A rollout's folders: the workspace the harness works in, and its private side.

    <work_root>/<rollout_id>/workspace/   # the task's starting files; the harness's cwd; snapshotted
    <work_root>/<rollout_id>/home/        # HOME for the harness (its config files), not snapshotted
    <work_root>/<rollout_id>/prompt.md    # the task prompt
    <work_root>/<rollout_id>/harness.log  # the harness's stdout and stderr
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

# The evaluator's deletion, which makes read-only folders (Go's module cache, a test's
# chmod) writable first: plain rmtree leaves them behind for a non-root runner.
from libs.common.fs import remove_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutDirs:
    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def prompt_file(self) -> Path:
        return self.root / "prompt.md"

    @property
    def log_file(self) -> Path:
        return self.root / "harness.log"


def prepare(work_root: Path, rollout_id: str, files_dir: Path | None, prompt: str) -> RolloutDirs:
    """Fresh folders for one rollout, the workspace a copy of the task's starting files."""
    dirs = RolloutDirs(work_root / rollout_id)
    if dirs.root.exists():
        remove_tree(dirs.root)
    dirs.root.mkdir(parents=True)
    if files_dir is not None:
        shutil.copytree(files_dir, dirs.workspace, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        dirs.workspace.mkdir()
    dirs.home.mkdir()
    dirs.prompt_file.write_text(prompt, encoding="utf-8")
    return dirs


def remove(dirs: RolloutDirs) -> bool:
    """Delete a rollout's folders; False (and the leftover logged) if some could not be."""
    try:
        remove_tree(dirs.root)
    except FileNotFoundError:
        pass
    except OSError as exc:
        left = _leftovers(dirs.root)
        log.error("rollout %s: could not delete %s (%s); left on disk: %s%s", dirs.root.name, dirs.root, exc,
                  ", ".join(left[:10]), " ..." if len(left) > 10 else "")
        return False
    return True


def _leftovers(root: Path) -> list[str]:
    try:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    except OSError:
        return [str(root)]


def log_tail(dirs: RolloutDirs, max_bytes: int = 4000) -> str:
    try:
        with dirs.log_file.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
