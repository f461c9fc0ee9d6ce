"""``bench.cpu_waits``: per-thread run and run-queue wait times from the kernel, for this
process's own threads (a real reading, not a fixture), and their difference."""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest

from bench.cpu_waits import engine_processes, run_and_wait_s, thread_times
from vllm_hybrid_nixl.common.netutil import free_port


def test_this_process_threads_are_read_and_their_run_time_grows() -> None:
    me = [psutil.Process(os.getpid())]
    before = thread_times(me)
    if not before:
        pytest.fail("no /proc/<pid>/task/*/schedstat on this kernel")
    spin_until = time.monotonic() + 0.2
    while time.monotonic() < spin_until:  # this (main) thread runs ~0.2 s
        pass
    figures = run_and_wait_s(before, thread_times(me))
    assert figures["run_s"] >= 0.05  # ran for most of the ~0.2 s, on any loaded machine
    assert figures["wait_for_cpu_s"] >= 0.0


def test_differences_and_no_readings() -> None:
    before = {(1, "1"): (1_000_000_000, 0)}
    after = {(1, "1"): (3_000_000_000, 500_000_000), (1, "2"): (1_000_000_000, 0)}
    assert run_and_wait_s(before, after) == {"run_s": 3.0, "wait_for_cpu_s": 0.5}
    assert all(math.isnan(v) for v in run_and_wait_s(before, {}).values())


def test_no_engine_on_a_port_is_a_clear_error() -> None:
    port = free_port()
    with pytest.raises(LookupError, match=f"port {port}"):
        engine_processes(f"http://127.0.0.1:{port}")
