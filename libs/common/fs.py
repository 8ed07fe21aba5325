"""File-system helpers shared by services."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def remove_tree(path: Path) -> None:
    """Delete a workspace, including folders the tests left unreadable or read-only.

    On a failure, the folder holding the entry (never above ``path``) and the entry itself
    are made accessible and the removal is retried once: a folder by removing it whole
    again, anything else by unlinking it (links are not followed). A second failure on
    the same entry raises.
    """
    top = os.path.abspath(path)
    retried: set[str] = set()

    def unlock(_func, p, exc_info) -> None:
        if p in retried:
            raise exc_info[1]
        retried.add(p)
        if os.path.abspath(p) != top:
            with contextlib.suppress(OSError):
                os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
            shutil.rmtree(p, onerror=unlock)
        elif os.path.lexists(p):
            os.unlink(p)

    shutil.rmtree(path, onerror=unlock)
