"""Find threads that busy-poll a core and give them idle priority (Linux ``SCHED_IDLE``).

NIXL's Python agent starts its progress thread with no delay between polls, so on vLLM's CPU
build every engine has one thread spinning on a core, the core its compute threads run on.
At idle priority it still polls whenever the core has nothing else to do, but never takes
the core from the engine's own work.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TASKS = Path("/proc/self/task")


def thread_ids() -> set[int]:
    return {int(name) for name in os.listdir(TASKS)}


def cpu_seconds(tid: int, pid: int | None = None) -> float:
    """User + system CPU time of one thread of this process, or of process ``pid`` (0 if it
    is gone)."""
    tasks = TASKS if pid is None else Path(f"/proc/{pid}/task")
    try:
        stat = (tasks / str(tid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_threads(candidates: set[int], sample_s: float = 0.5, share: float = 0.15) -> list[int]:
    """Those of ``candidates`` that used at least ``share`` of a core over ``sample_s``."""
    before = {tid: cpu_seconds(tid) for tid in candidates}
    time.sleep(sample_s)
    return sorted(tid for tid in candidates if cpu_seconds(tid) - before[tid] >= share * sample_s)


def _set_policy(tids: list[int], policy: int) -> list[int]:
    done = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done.append(tid)
        except (OSError, AttributeError):
            continue
    return done


def make_idle(tids: list[int]) -> list[int]:
    """Give each thread SCHED_IDLE; returns those that took it."""
    return _set_policy(tids, os.SCHED_IDLE)


def make_normal(tids: list[int]) -> list[int]:
    """Give each thread back the normal policy (SCHED_OTHER); returns those that took it."""
    return _set_policy(tids, os.SCHED_OTHER)


def can_undo_idle() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to SCHED_OTHER: Linux
    lets anyone lower a thread's priority but raising it again needs CAP_SYS_NICE, which
    Docker's default capability set and non-root users lack. Tried on a thread of its own."""
    answer: list[bool] = []

    def trial() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            answer.append(False)  # cannot even lower it: nothing would be idled either
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=trial, name="sched-idle-trial", daemon=True)
    thread.start()
    thread.join(5)
    return bool(answer and answer[0])
