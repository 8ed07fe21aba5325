"""A child process that dies with its parent, on Linux (``PR_SET_PDEATHSIG``).

``die_with_parent(sig)`` is a ``preexec_fn``: the child gets ``sig`` when the thread that
started it ends, the parent's own SIGKILL included. libc is resolved here, at import, not
in the forked child (no dynamic loading between fork and exec in a process with threads).
Where there is no such call (not Linux), the child is started as ever.
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable

try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(sig))

    return preexec
