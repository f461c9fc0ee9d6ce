"""Child-process helpers shared by the launchers and the router."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started us dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
