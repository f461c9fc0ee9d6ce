"""NIXL progress-thread care with and without CAP_SYS_NICE (real threads, real scheduler
calls; ``capsh --drop=cap_sys_nice`` takes the capability away as Docker's default set does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from vllm_hybrid_nixl.connector import thread_priority

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent(
    """
    import os, threading, time
    SAMPLE_S = 5.0
    from vllm_hybrid_nixl.connector import thread_priority
    from vllm_hybrid_nixl.connector.thread_care import ProgressThreadCare

    stop, ids = threading.Event(), {}
    def spin():
        ids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass
    before = thread_priority.thread_ids()
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.1)
    # A long sample: registration (before/after) happens while it still runs, and must
    # not wait for it.
    care = ProgressThreadCare(thread_priority.thread_ids() - before, sample_s=SAMPLE_S)
    care.before_registration()
    during = os.sched_getscheduler(ids["spin"])
    care.after_registration()
    not_waited = not care.wait_for_sample(timeout_s=0)
    assert care.wait_for_sample(timeout_s=60)
    after = os.sched_getscheduler(ids["spin"])
    stop.set()
    print(care.can_undo, during == os.SCHED_OTHER, after == os.SCHED_IDLE, not_waited)
    """
)


def run(prefix: list[str]) -> str:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_registration_runs_at_normal_priority_and_ends_idle() -> None:
    assert run([]) == ["True", "True", "True", "True"]


def test_without_cap_sys_nice_nothing_is_idled_until_registration_is_done() -> None:
    """Docker's default capability set: a thread at idle priority could never come back, so
    it is left at normal priority until registration is done, then idled for good. As root
    the capability is dropped with capsh; other users lack it already."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        assert shutil.which("capsh"), "capsh (Debian's libcap2-bin) is needed to drop it"
        prefix = ["capsh", "--drop=cap_sys_nice", "--", "-c", 'exec "$0" "$@"']
    assert run(prefix) == ["False", "True", "True", "True"]


def test_this_process_can_undo_idle_as_root() -> None:
    assert thread_priority.can_undo_idle() is (os.geteuid() == 0)
