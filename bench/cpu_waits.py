"""How long an engine's threads ran and how long they waited, runnable, for a CPU, from the
kernel's per-thread ``/proc/<pid>/task/<tid>/schedstat`` (run ns, run-queue wait ns). vLLM's
CPU workers spin while idle, so CPU time alone says little; the wait says how much of its
time other processes on its core (a router, a load generator, the other engine) took."""

from __future__ import annotations

import glob
import math

import psutil

ThreadTimes = dict[tuple[int, str], tuple[int, int]]


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
            except (OSError, ValueError):
                continue  # a thread that ended, or a kernel without schedstat
            times[(process.pid, path.split("/")[4])] = (ran, waited)
    return times


def run_and_wait_s(before: ThreadTimes, after: ThreadTimes) -> dict[str, float]:
    """Seconds the threads ran and waited for a CPU between two readings (NaN without
    readings: a kernel without schedstat)."""
    if not after:
        return {"run_s": math.nan, "wait_for_cpu_s": math.nan}
    ran = waited = 0
    for key, (run_now, wait_now) in after.items():
        run_then, wait_then = before.get(key, (0, 0))
        ran += run_now - run_then
        waited += wait_now - wait_then
    return {"run_s": ran / 1e9, "wait_for_cpu_s": waited / 1e9}
