"""Child-process helpers shared by the launchers and the router."""

from __future__ import annotations

import ctypes
import signal
import subprocess


def die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started us dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_child(process: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGTERM ``process`` (a child we started), SIGKILL it after ``grace_s``; reaped."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
