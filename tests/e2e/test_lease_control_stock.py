"""The negative control of ``test_lease_guard``: the same late-leg scenario with vLLM's
stock NixlConnector on both engines answers HTTP 200 with wrong tokens. If this ever stops
corrupting, the guard's tests no longer show that the guard is what prevents it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.lease_scenario import body, expected_texts, late_legs
from tests.e2e.pd_fixture import COMMON_ARGS, PdPair, start_pair
from tests.harness.releases import STOCK_REFUSAL, stock_is_strict
from vllm_hybrid_nixl.deploy.pd_client import prefill_body

pytestmark = pytest.mark.e2e

SMALL_CACHE = [*COMMON_ARGS, "--num-gpu-blocks-override", "96"]


@pytest.fixture(scope="module")
def stock_pair(tiny_hybrid_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    """On 0.24-0.25 the stock connector cannot start on vLLM's CPU build at all (shown by
    test_pd_plain_and_stock), so there is no stock P/D to corrupt: skipped there, by name."""
    if stock_is_strict():
        pytest.skip(
            "vLLM's stock NixlConnector does not start on this release's CPU build "
            f"({STOCK_REFUSAL}); the negative control needs a release where it serves"
        )
    yield from start_pair(
        tiny_hybrid_model,
        tmp_path_factory.mktemp("stock-control"),
        prefill={
            "connector": "NixlConnector",
            "kv_extra_config": {"kv_lease_duration": 3},
            "extra_args": SMALL_CACHE,
        },
        decode={"connector": "NixlConnector", "extra_args": SMALL_CACHE},
    )


def test_the_stock_connector_answers_late_legs_with_wrong_tokens(stock_pair: PdPair) -> None:
    expected = expected_texts(stock_pair.decode.spec.url, stock_pair.model)
    outcome = late_legs(stock_pair, expected, wait_s=8)
    assert outcome.wrong_200 >= 1, outcome


def test_the_stock_connector_answers_a_batch_from_one_prompts_kv(stock_pair: PdPair) -> None:
    """The control of test_integrity's batch tests: a prompt list sent to the engines with
    the parameters vLLM returns for it (the first prompt's) decodes the second prompt from
    the first one's KV, and caches it: the second prompt alone is then answered wrong too."""
    first = "The harbour master counted ships at dawn and wrote each name in the ledger. " * 3
    second = "A gull circled the old lighthouse while the keeper mended nets by the door. " * 3
    url = stock_pair.prefill.spec.url
    with httpx.Client(timeout=300) as client:
        alone = client.post(f"{url}/v1/completions", json=body(stock_pair.model, second))
        expected = alone.json()["choices"][0]["text"]
        prefill = client.post(
            f"{url}/v1/completions", json=prefill_body(body(stock_pair.model, [first, second]))
        )
        params = prefill.json()["kv_transfer_params"]
        decode = client.post(
            f"{stock_pair.decode.spec.url}/v1/completions",
            json={**body(stock_pair.model, [first, second]), "kv_transfer_params": params},
        )
        assert decode.status_code == 200, decode.text
        batch = sorted(decode.json()["choices"], key=lambda c: c["index"])
        later = client.post(
            f"{stock_pair.decode.spec.url}/v1/completions", json=body(stock_pair.model, second)
        )
    assert batch[1]["text"] != expected  # HTTP 200, another prompt's answer
    assert later.json()["choices"][0]["text"] != expected  # the decode's cache is poisoned
