"""The CPUs a process may really use: its affinity (checked in a real child process confined
the way ``taskset`` or a container's cpuset confines one), lowered to a cgroup v2 quota."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid_nixl.common.cpus import cgroup_cpu_limit, usable_cpus

pytestmark = pytest.mark.integration


def test_a_confined_process_counts_only_its_cores() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from vllm_hybrid_nixl.common.cpus import usable_cpus as u; print(u())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1"]
    assert usable_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("max 100000\n", None),
        ("150000 100000\n", 1.5),
        ("50000 100000", 0.5),
        ("x y", None),
        ("", None),
    ],
)
def test_a_cgroup_quota_is_read_in_cpus(tmp_path: Path, text: str, limit: float | None) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert cgroup_cpu_limit(cpu_max) == limit
    expected = len(os.sched_getaffinity(0))
    if limit is not None:
        expected = max(1, min(expected, -(-limit // 1)))
    assert usable_cpus(cpu_max) == expected


def test_no_cgroup_file_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "missing") is None
