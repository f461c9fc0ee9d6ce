"""Core shares across raylets (``placement.core_shares``) and the machine key that groups
them. Pure placement logic that no vLLM release changes, so it lives outside the version
matrix (``scripts/matrix-tests.txt``); ``machine_id`` is read in a child process too."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.deploy.placement import PlacedEngine, core_shares, machine_id

pytestmark = pytest.mark.integration


def placed(name: str, role: str, machine: str, cores: tuple[int, ...]) -> PlacedEngine:
    return PlacedEngine(name, role, machine, cores)


def test_raylets_sharing_a_machine_and_cores_never_put_prefill_and_decode_on_one_core() -> None:
    """Ray's local clusters: every raylet may use cores 0-1. Split per raylet, each raylet
    would give its one engine both cores (prefill and decode on the same cores)."""
    shares = core_shares(
        [
            placed("p0", "prefill", "m", (0, 1)),  # raylet A
            placed("p1", "prefill", "m", (0, 1)),  # raylet A
            placed("d0", "decode", "m", (0, 1)),  # raylet B
            placed("d1", "decode", "m", (0, 1)),  # raylet B
        ]
    )
    assert shares == {"p0": [0], "p1": [0], "d0": [1], "d1": [1]}


def test_raylets_with_disjoint_cores_or_on_other_machines_keep_their_own_cores() -> None:
    shares = core_shares(
        [
            placed("p0", "prefill", "m", (0,)),  # raylets under taskset on one machine
            placed("d0", "decode", "m", (1,)),
            placed("p1", "prefill", "other", (0, 1, 2, 3)),  # another machine
            placed("d1", "decode", "other2", (0, 1)),
        ]
    )
    assert shares == {"p0": [0], "d0": [1], "p1": [0, 1, 2, 3], "d1": [0, 1]}


def test_machine_id_is_stable_and_shared_by_processes_of_one_machine() -> None:
    import subprocess
    import sys

    here = machine_id()
    child = subprocess.run(
        [sys.executable, "-c", "from vllm_hybrid_nixl.deploy.placement import machine_id;"
         "print(machine_id())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert here and child == here
