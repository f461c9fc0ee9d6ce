"""Busy-polling threads are found by their CPU time and put at idle priority (real threads,
real scheduler calls)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from vllm_hybrid_nixl.connector import thread_priority

pytestmark = pytest.mark.unit


def test_a_spinning_thread_is_found_and_made_idle_and_a_sleeping_one_is_left_alone() -> None:
    stop = threading.Event()
    ids: dict[str, int] = {}

    def spin() -> None:
        ids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def sleep() -> None:
        ids["sleep"] = threading.get_native_id()
        stop.wait()

    before = thread_priority.thread_ids()
    threads = [threading.Thread(target=f, daemon=True) for f in (spin, sleep)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    try:
        new = thread_priority.thread_ids() - before
        assert {ids["spin"], ids["sleep"]} <= new
        busy = thread_priority.busy_threads(new, sample_s=0.5, share=0.05)
        assert busy == [ids["spin"]]
        assert thread_priority.make_idle(busy) == busy
        assert os.sched_getscheduler(ids["spin"]) == os.SCHED_IDLE
        assert os.sched_getscheduler(ids["sleep"]) == os.SCHED_OTHER
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def test_a_thread_that_does_not_exist_counts_as_idle_and_is_skipped() -> None:
    missing = 2**22 + 1  # above the largest pid_max Linux allows
    assert thread_priority.cpu_seconds(missing) == 0.0
    assert thread_priority.make_idle([missing]) == []
