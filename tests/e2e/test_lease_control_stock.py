"""The negative control of ``test_lease_guard``: the same late-leg scenario with vLLM's
stock NixlConnector on both engines answers HTTP 200 with wrong tokens. If this ever stops
corrupting, the guard's tests no longer show that the guard is what prevents it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.lease_scenario import expected_texts, late_legs
from tests.e2e.pd_fixture import COMMON_ARGS, start_pair
from tests.harness.releases import STOCK_REFUSAL, stock_is_strict

pytestmark = pytest.mark.e2e

SMALL_CACHE = [*COMMON_ARGS, "--num-gpu-blocks-override", "96"]


def test_the_stock_connector_answers_late_legs_with_wrong_tokens(
    tiny_hybrid_model: Path, tmp_path: Path
) -> None:
    """On 0.24-0.25 the stock connector cannot start on vLLM's CPU build at all (shown by
    test_pd_plain_and_stock), so there is no stock P/D to corrupt: skipped there, by name."""
    if stock_is_strict():
        pytest.skip(
            "vLLM's stock NixlConnector does not start on this release's CPU build "
            f"({STOCK_REFUSAL}); the negative control needs a release where it serves"
        )
    pair_iter = start_pair(
        tiny_hybrid_model,
        tmp_path,
        prefill={
            "connector": "NixlConnector",
            "kv_extra_config": {"kv_lease_duration": 3},
            "extra_args": SMALL_CACHE,
        },
        decode={"connector": "NixlConnector", "extra_args": SMALL_CACHE},
    )
    pair = next(pair_iter)
    try:
        expected = expected_texts(pair.decode.spec.url, pair.model)
        outcome = late_legs(pair, expected, wait_s=8)
    finally:
        pair_iter.close()
    assert outcome.wrong_200 >= 1, outcome
