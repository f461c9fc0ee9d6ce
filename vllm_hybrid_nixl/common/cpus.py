"""How many CPUs this process can really use."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> float | None:
    """The cgroup v2 CPU quota in CPUs (``quota / period``); None when unlimited or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset), lowered
    to a cgroup CPU quota when one is set; at least 1. Ray's own count reads the quota but
    not the affinity, so a local Ray cluster started without this can plan engines onto CPUs
    the process cannot use."""
    count = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(cpu_max)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(count, 1)
