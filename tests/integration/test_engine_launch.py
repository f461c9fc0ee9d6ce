"""How an engine's process is started: confined to its cores, children included, and a core
it may not use refused before anything starts. Real child processes, no engine needed."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest

from vllm_hybrid_nixl.deploy.engines import (
    EngineProcess,
    EngineSpec,
    EngineStartError,
    start_engine_child,
)

pytestmark = pytest.mark.integration

#: Prints its own cores, then those of a child it starts (as vLLM's engine core is).
REPORT_CORES = (
    "import os, subprocess, sys\n"
    "print(sorted(os.sched_getaffinity(0)))\n"
    "child = 'import os; print(sorted(os.sched_getaffinity(0)))'\n"
    "print(subprocess.check_output([sys.executable, '-c', child], text=True).strip())\n"
)


def cores_seen(cores: list[int] | None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", REPORT_CORES],
        preexec_fn=partial(start_engine_child, cores),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.split("\n")[:2]


def test_an_engine_and_its_children_run_only_on_its_cores() -> None:
    core = max(os.sched_getaffinity(0))
    assert cores_seen([core]) == [f"[{core}]", f"[{core}]"]


def test_without_cores_an_engine_keeps_every_core_it_was_given() -> None:
    everything = str(sorted(os.sched_getaffinity(0)))
    assert cores_seen(None) == [everything, everything]


def test_a_core_this_process_may_not_use_is_refused_before_starting(tmp_path) -> None:
    outside = max(os.sched_getaffinity(0)) + 1000
    spec = EngineSpec(model="unused", port=1, role="decode", cpu_core=[outside])
    engine = EngineProcess(spec, tmp_path / "decode.log")
    with pytest.raises(EngineStartError, match=rf"cpu_core \[{outside}\].*may use"):
        engine.start()
    assert engine.process is None and not (tmp_path / "decode.log").exists()
