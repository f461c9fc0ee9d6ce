"""Core placement keeps prefill and decode engines on disjoint cores whenever it can."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.deploy.placement import engine_cores

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("prefill", "decode", "cores", "expected"),
    [
        (1, 1, 2, ([0], [1])),
        (2, 1, 2, ([0, 0], [1])),  # the 2P1D shape that stalled when decode shared core 0
        (1, 2, 2, ([0], [1, 1])),
        (2, 2, 2, ([0, 0], [1, 1])),
        (2, 2, 8, ([0, 1], [2, 3])),
        (3, 1, 3, ([0, 1, 0], [2])),
        (1, 1, 1, ([0], [0])),
        (2, 0, 2, ([0, 1], [])),
    ],
)
def test_engine_cores(prefill: int, decode: int, cores: int, expected) -> None:
    assert engine_cores(prefill, decode, cores) == expected


@pytest.mark.parametrize("prefill", range(0, 5))
@pytest.mark.parametrize("decode", range(0, 5))
@pytest.mark.parametrize("cores", range(2, 6))
def test_roles_never_share_a_core_when_both_exist(prefill: int, decode: int, cores: int) -> None:
    p, d = engine_cores(prefill, decode, cores)
    assert len(p) == prefill and len(d) == decode
    assert all(0 <= core < cores for core in p + d)
    assert not set(p) & set(d)


def test_bad_counts_are_explained() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        engine_cores(1, 1, 0)


@pytest.mark.parametrize(
    ("prefill", "decode", "cores", "expected"),
    [
        (1, 1, 64, ([list(range(32))], [list(range(32, 64))])),  # not 2 cores of 64
        (2, 1, 7, ([[0, 1, 2], [3, 4]], [[5, 6]])),
        (1, 1, 2, ([[0]], [[1]])),
        (2, 2, 2, ([[0], [0]], [[1], [1]])),  # fewer cores than engines: as engine_cores
    ],
)
def test_each_engine_gets_its_share_of_its_nodes_cores(prefill, decode, cores, expected) -> None:
    from vllm_hybrid_nixl.deploy.placement import engine_core_sets

    assert engine_core_sets(prefill, decode, cores) == expected


def test_core_lists_are_written_as_vllm_reads_them() -> None:
    from vllm_hybrid_nixl.deploy.placement import cpu_list

    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_list([3]) == "3"
