"""Registration and NIXL transfers work without CAP_SYS_NICE (Docker's default capability set,
and every non-root user): the worker tests that register real caches with real NIXL agents and
move bytes between them run again in a process without that capability."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def without_cap_sys_nice(command: list[str]) -> subprocess.CompletedProcess[str]:
    prefix: list[str] = []
    if os.geteuid() == 0:
        assert shutil.which("capsh"), "capsh (Debian's libcap2-bin) is needed to drop it"
        prefix = ["capsh", "--drop=cap_sys_nice", "--", "-c", 'exec "$0" "$@"']
    return subprocess.run(
        [*prefix, *command], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_capability_really_is_gone() -> None:
    done = without_cap_sys_nice(
        [
            sys.executable,
            "-c",
            "from vllm_hybrid_nixl.connector import thread_priority as t; print(t.can_undo_idle())",
        ]
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_registration_and_transfers_without_cap_sys_nice() -> None:
    done = without_cap_sys_nice(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/integration/test_worker_registration.py",
            "-k", "moves_the_right_bytes and (logical-2 or physical-2 or flat-1)",
        ]
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert "3 passed" in done.stdout, tail
