"""Child-process helpers shared by the launchers and the router."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time


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


def kill_leftover_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL what is left of process group ``pgid`` (children that outlived their leader)
    and wait until it is gone, so its ports are free again. Linux does not hand out a PID
    that is still a live group's ID, so this never reaches an unrelated process."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)
