"""How long an engine's threads ran and how long they waited, runnable, for a CPU, from the
kernel's per-thread ``/proc/<pid>/task/<tid>/schedstat`` (run ns, run-queue wait ns), in all
and per thread name. A busy vLLM CPU engine's threads poll (``sched_yield``) for a second
after each message, so its CPU time says little; the wait says how long its threads stood
ready to run while something else had the core: another process (a router, a load
generator) or the engine's own other threads (summed over threads, waits overlap). Engines
are found by the ``--port`` on their ``serve`` command line."""

from __future__ import annotations

import glob
import math
from typing import Any

import psutil

ThreadTimes = dict[tuple[int, str, str], tuple[int, int]]  # (pid, tid, name) -> ns


def engine_processes(url: str) -> list[psutil.Process]:
    """The ``vllm serve`` process listening on ``url``'s port and all its children."""
    port = url.rsplit(":", 1)[1].rstrip("/")
    for process in psutil.process_iter(["cmdline"]):
        words = process.info["cmdline"] or []
        if "serve" in words and any(
            a == "--port" and b == port for a, b in zip(words, words[1:], strict=False)
        ):
            return [process, *process.children(recursive=True)]
    raise LookupError(f"no vllm serve process listens on port {port}")


def thread_times(processes: list[psutil.Process]) -> ThreadTimes:
    """Per thread of ``processes``: (ns run, ns waited for a CPU) so far."""
    times: ThreadTimes = {}
    for process in processes:
        for path in glob.glob(f"/proc/{process.pid}/task/*/schedstat"):
            try:
                with open(path) as stat:
                    ran, waited, _ = (int(field) for field in stat.read().split())
                with open(path.replace("schedstat", "comm")) as comm:
                    name = comm.read().strip()
            except (OSError, ValueError):
                continue  # a thread that ended, or a kernel without schedstat
            times[(process.pid, path.split("/")[4], name)] = (ran, waited)
    return times


def run_and_wait_s(before: ThreadTimes, after: ThreadTimes) -> dict[str, Any]:
    """Seconds the threads ran and waited for a CPU between two readings, in all and per
    thread name (``wait_by_thread_s``); NaN without readings (a kernel without schedstat).
    A thread that ended between the readings is left out; one that began counts from 0."""
    if not after:
        return {"run_s": math.nan, "wait_for_cpu_s": math.nan, "wait_by_thread_s": {}}
    ran = waited = 0
    by_name: dict[str, float] = {}
    earlier = {(pid, tid): times for (pid, tid, _), times in before.items()}
    for key, (run_now, wait_now) in after.items():
        run_then, wait_then = earlier.get(key[:2], (0, 0))  # a renamed thread is the same
        ran += run_now - run_then
        waited += wait_now - wait_then
        by_name[key[2]] = by_name.get(key[2], 0.0) + (wait_now - wait_then) / 1e9
    return {"run_s": ran / 1e9, "wait_for_cpu_s": waited / 1e9, "wait_by_thread_s": by_name}
