"""``HybridNixlPushConnector`` (push mode) in real ``vllm serve`` processes, loaded the two
other ways a user can: the prefill engine with ``VLLM_PLUGINS=hybrid_nixl`` (plugin filter
naming us) and the decode engine with ``kv_connector_module_path`` while ``VLLM_PLUGINS``
filters our plugin out. P/D through the router (one request id for both legs: vLLM pairs
push legs by it) equals the prefill engine alone; decode legs later than the prefill's 3 s
lease fail at once by name instead of waiting for vLLM's 480 s push watchdog, and the
router re-runs such a request on a fresh prefill."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.lease_scenario import PROMPTS as LEASE_PROMPTS
from tests.e2e.lease_scenario import body, expected_texts, late_legs
from tests.e2e.pd_fixture import (
    WORKER_LINE,
    PdPair,
    compute_paused,
    engine_posts,
    metric_sum,
    running_router,
    start_pair,
)
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.router.backends import BackendPool

pytestmark = pytest.mark.e2e

#: Before 0.32 a refused pin makes the decode engine compute the prompt itself (no failure).
FAILS_LOUDLY = compat.transfer_results_api()


@pytest.fixture(scope="module")
def pair(tiny_hybrid_model, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(
        tiny_hybrid_model,
        tmp_path_factory.mktemp("pd-push-logs"),
        prefill={
            "connector": "HybridNixlPushConnector",
            "env": {"VLLM_PLUGINS": "hybrid_nixl"},
            "kv_extra_config": {"kv_lease_duration": 3},
        },
        decode={
            "connector": "HybridNixlPushConnector",
            "connector_module_path": "vllm_hybrid_nixl.connector.connectors",
            "env": {"VLLM_PLUGINS": "some_other_plugin"},
        },
    )


def test_both_sides_run_our_push_worker(pair: PdPair) -> None:
    for engine in (pair.prefill, pair.decode):
        classes = [m["cls"] for m in WORKER_LINE.finditer(engine.log_text())]
        assert classes == ["HybridNixlPushWorker"], engine.log_path


def test_push_worker_is_ready_to_write(pair: PdPair) -> None:
    """Registration went through vLLM's push path: the writer thread started afterwards."""
    for engine in (pair.prefill, pair.decode):
        text = engine.log_text()
        registered = text.index("vllm-hybrid-nixl: HybridNixlPushWorker")
        assert text.index("nixl-push-writer thread started", registered) > registered


@pytest.fixture(scope="module")
def router_url(pair: PdPair) -> Iterator[str]:
    with running_router(
        BackendPool.from_urls([pair.prefill.spec.url], [pair.decode.spec.url])
    ) as url:
        yield url


@pytest.fixture(scope="module")
def expected(pair: PdPair) -> dict[str, str]:
    return expected_texts(pair.prefill.spec.url, pair.model)


def test_push_pd_through_the_router_equals_the_prefill_engine_alone(
    pair: PdPair, router_url: str, expected: dict[str, str]
) -> None:
    with httpx.Client(timeout=120.0) as client:
        before = read_kv_transfer_counters(pair.decode.spec.url, client)
        for prompt in LEASE_PROMPTS[:2]:
            answer = client.post(f"{router_url}/v1/completions", json=body(pair.model, prompt))
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected[prompt]
        moved = read_kv_transfer_counters(pair.decode.spec.url, client) - before
    assert moved.external_prompt_tokens > 0  # the decode engine computed no prompt itself


def test_late_push_decode_legs_fail_at_once_by_name(pair: PdPair, expected: dict[str, str]) -> None:
    """Decode legs sent after the prefill's lease ran out (and churn reused its blocks): an
    error each (under vLLM's 480 s push watchdog they would wait past the client's 120 s),
    never HTTP 200 with other tokens, both engines alive."""
    outcome = late_legs(pair, expected, wait_s=5)
    outcome.assert_guarded()
    if FAILS_LOUDLY:
        assert pair.decode.log_text().count("its lease expired") >= 4
    assert pair.prefill.alive() and pair.decode.alive()


def test_the_router_reruns_a_push_request_whose_decode_leg_came_late(
    pair: PdPair, router_url: str, expected: dict[str, str]
) -> None:
    """The decode engine's compute paused past the prefill's lease while the router's
    request waits on it: its pin is refused, the router runs the request again (a fresh
    prefill leg under a new request id) and the client gets the right answer."""
    prompt = LEASE_PROMPTS[2]
    reruns_before = metric_sum(router_url, "router_lease_reruns_total")
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        with httpx.Client(timeout=300.0) as client:
            result["answer"] = client.post(
                f"{router_url}/v1/completions", json=body(pair.model, prompt)
            )

    prefill_posts = engine_posts(pair.prefill.spec.url)
    with compute_paused(pair.decode.pid):
        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 120
        while engine_posts(pair.prefill.spec.url) == prefill_posts:  # the prefill leg answered
            assert time.monotonic() < deadline, "the prefill leg was not answered"
            time.sleep(0.2)
        time.sleep(5)  # past the 3 s lease; the decode engine has not seen the request yet
    sender.join(timeout=300)
    answer = result["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected[prompt]
    if FAILS_LOUDLY:
        assert metric_sum(router_url, "router_lease_reruns_total") - reruns_before == 1
