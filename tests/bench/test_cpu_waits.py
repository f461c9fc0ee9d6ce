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
    ran_from, give_up = time.thread_time(), time.monotonic() + 60
    while time.thread_time() - ran_from < 0.1 and time.monotonic() < give_up:
        pass  # this (main) thread runs 0.1 s of CPU, however loaded the machine
    figures = run_and_wait_s(before, thread_times(me))
    assert figures["run_s"] >= 0.09
    assert figures["wait_for_cpu_s"] >= 0.0


def test_differences_per_thread_name_and_no_readings() -> None:
    before = {(1, "1", "Worker"): (1_000_000_000, 0)}
    after = {
        (1, "1", "Worker"): (3_000_000_000, 500_000_000),
        (1, "2", "python"): (1_000_000_000, 250_000_000),  # began between the readings
    }
    figures = run_and_wait_s(before, after)
    assert figures["run_s"] == 3.0 and figures["wait_for_cpu_s"] == 0.75
    assert figures["wait_by_thread_s"] == {"Worker": 0.5, "python": 0.25}
    empty = run_and_wait_s(before, {})
    assert math.isnan(empty["run_s"]) and math.isnan(empty["wait_for_cpu_s"])


def test_no_engine_on_a_port_is_a_clear_error() -> None:
    port = free_port()
    with pytest.raises(LookupError, match=f"port {port}"):
        engine_processes(f"http://127.0.0.1:{port}")
