"""A decode leg that arrives after the prefill engine released its blocks fails loudly.

Real ``vllm serve`` engines with HybridNixlConnector on a tiny sliding-window hybrid: the
prefill engine has a short lease (3 s) and a small cache, so churn between the legs reuses
the released blocks. Without the guard (the stock connector, ``test_lease_control_stock``)
the same scenario answers HTTP 200 with wrong tokens, so these tests can fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.lease_scenario import expected_texts, late_legs
from tests.e2e.pd_fixture import COMMON_ARGS, PdPair, start_pair
from vllm_hybrid_nixl.engines import EngineProcess

pytestmark = pytest.mark.e2e

SMALL_CACHE = [*COMMON_ARGS, "--num-gpu-blocks-override", "96"]
REFUSAL = "released its KV blocks"


@pytest.fixture(scope="module")
def guarded(tiny_hybrid_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(
        tiny_hybrid_model,
        tmp_path_factory.mktemp("lease-logs"),
        prefill={"kv_extra_config": {"kv_lease_duration": 3}, "extra_args": SMALL_CACHE},
        decode={"extra_args": SMALL_CACHE},
    )


@pytest.fixture(scope="module")
def expected(guarded: PdPair) -> dict[str, str]:
    return expected_texts(guarded.decode.spec.url, guarded.model)


def test_decode_legs_after_the_lease_and_block_reuse_fail_loudly(
    guarded: PdPair, expected: dict[str, str]
) -> None:
    outcome = late_legs(
        guarded.prefill.spec.url, guarded.decode.spec.url, guarded.model, expected, wait_s=8
    )
    assert outcome.wrong_200 == 0, outcome
    assert len(outcome.errors) == outcome.sent == 4, outcome
    log = guarded.decode.log_text()
    assert log.count(REFUSAL) >= 4 and "lease expired" in log
    assert "raise kv_lease_duration" in log


def test_decode_legs_within_the_lease_still_read_the_kv(
    guarded: PdPair, expected: dict[str, str]
) -> None:
    """The guard refuses only what was released: prompt legs sent at once succeed."""
    outcome = late_legs(
        guarded.prefill.spec.url,
        guarded.decode.spec.url,
        guarded.model,
        expected,
        wait_s=0,
        between=lambda: None,
    )
    assert outcome.correct == 4 and not outcome.errors, outcome


def test_a_prefill_engine_restarted_between_the_legs_is_detected(
    guarded: PdPair, expected: dict[str, str], tmp_path: Path
) -> None:
    """Same address, same ports, a new process: its lease epoch differs."""

    def restart() -> None:
        guarded.prefill.stop()
        fresh = EngineProcess(guarded.prefill.spec, tmp_path / "prefill-restarted.log")
        fresh.start().wait_healthy(timeout_s=420)
        guarded.prefill.process = fresh.process
        guarded.prefill.log_path = fresh.log_path

    outcome = late_legs(
        guarded.prefill.spec.url,
        guarded.decode.spec.url,
        guarded.model,
        expected,
        wait_s=0,
        between=restart,
    )
    assert outcome.wrong_200 == 0, outcome
    assert outcome.correct + len(outcome.errors) == 4
    assert "restarted" in guarded.decode.log_text() or outcome.errors
