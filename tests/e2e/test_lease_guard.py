"""A decode leg that arrives after the prefill engine released its blocks fails loudly.

Real ``vllm serve`` engines with HybridNixlConnector on a tiny sliding-window hybrid: the
prefill engine has a short lease (3 s) and a small cache, so churn between the legs reuses
the released blocks. Without the guard (the stock connector: the stock controls in
``test_layout_guard``) the same scenario answers HTTP 200 with wrong tokens, so these tests
can fail.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.lease_scenario import (
    PROMPTS,
    LateLegOutcome,
    body,
    decode_legs,
    expected_texts,
    late_legs,
    prefill_legs,
)
from tests.e2e.pd_fixture import (
    COMMON_ARGS,
    PdPair,
    engine_posts,
    running_router,
    start_pair,
)
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.deploy.engines import EngineProcess
from vllm_hybrid_nixl.deploy.metrics_text import sample_sum
from vllm_hybrid_nixl.deploy.pd_client import prefill_body
from vllm_hybrid_nixl.router.backends import BackendPool

pytestmark = pytest.mark.e2e

SMALL_CACHE = [*COMMON_ARGS, "--num-gpu-blocks-override", "96"]
REFUSAL = "released its KV blocks"
LEASE_PORT = free_port()


@pytest.fixture(scope="module")
def guarded(tiny_hybrid_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(
        tiny_hybrid_model,
        tmp_path_factory.mktemp("lease-logs"),
        prefill={
            # A fixed lease port: a restarted engine answers there, under another epoch.
            "kv_extra_config": {"kv_lease_duration": 3, "lease_port": LEASE_PORT},
            "extra_args": SMALL_CACHE,
        },
        decode={"extra_args": SMALL_CACHE},
    )


@pytest.fixture(scope="module")
def expiring(guarded: PdPair, tmp_path_factory) -> Iterator[EngineProcess]:
    """A second prefill engine whose lease is over before any decode engine can pin it.
    Started (not awaited) before the other tests, so its start overlaps them."""
    spec = dataclasses.replace(
        guarded.prefill.spec,
        port=free_port(),
        side_channel_port=free_side_channel_port(),
        kv_extra_config={"kv_lease_duration": 0},
    )
    engine = EngineProcess(spec, tmp_path_factory.mktemp("lease-expiring") / "prefill.log")
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def expected(guarded: PdPair) -> dict[str, str]:
    return expected_texts(guarded.decode.spec.url, guarded.model)


def test_decode_legs_after_the_lease_and_block_reuse_fail_loudly(
    guarded: PdPair, expected: dict[str, str], expiring: EngineProcess
) -> None:
    outcome = late_legs(guarded, expected, wait_s=8)
    outcome.assert_guarded()
    log = guarded.decode.log_text()
    assert log.count(REFUSAL) >= 4 and "lease expired" in log
    assert "raise kv_lease_duration" in log


def test_decode_legs_within_the_lease_still_read_the_kv(
    guarded: PdPair, expected: dict[str, str]
) -> None:
    """The guard refuses only what was released: each prompt's decode leg sent right after
    its prefill leg succeeds. One prompt at a time, so the gap is one request however slow
    the machine (four prefill legs first took more than the 3 s lease on a loaded one)."""
    outcome = LateLegOutcome()
    for prompt in PROMPTS:
        saved = prefill_legs(guarded.prefill.spec.url, guarded.model, [prompt])
        one = decode_legs(guarded.decode.spec.url, guarded.model, saved, expected)
        outcome.correct += one.correct
        outcome.wrong_200 += one.wrong_200
        outcome.errors += one.errors
    assert outcome.correct == 4 and not outcome.errors, outcome


def test_expired_leases_free_a_full_cache_at_the_next_step(guarded: PdPair) -> None:
    """The prefill engine's 96 blocks filled with leases nobody reads (prefill legs only, 8
    blocks each): the legs after the first twelve wait for blocks, which come free when the
    first leases expire (3 s). vLLM frees blocks only for what a worker reports; expired
    leases are reported that way at the next step, also while the engine runs only empty
    steps for a waiting request. (Before, they waited for vLLM's own lease, pushed to lease +
    pin + 60 s = 93 s here, so each of these legs would outlast its 45 s timeout.)"""
    url = guarded.prefill.spec.url
    with httpx.Client(timeout=45) as client:
        for i in range(30):
            prompt = f"Cargo manifest {i}: " + "barrels of salt, coils of rope, lamp oil. " * 30
            leg = client.post(
                f"{url}/v1/completions", json=prefill_body(body(guarded.model, prompt, 2))
            )
            assert leg.status_code == 200, leg.text
    httpx.get(f"{url}/health", timeout=30).raise_for_status()


def test_a_prefill_engine_restarted_between_the_legs_is_detected(
    guarded: PdPair, expected: dict[str, str], tmp_path: Path
) -> None:
    """Same address, same ports, a new process: its lease epoch differs."""

    def restart() -> None:
        guarded.prefill.stop()
        # Back with vLLM's default lease (30 s), for the test after this one.
        spec = dataclasses.replace(guarded.prefill.spec, kv_extra_config={"lease_port": LEASE_PORT})
        guarded.prefill.spec, guarded.prefill.log_path = spec, tmp_path / "prefill-restarted.log"
        guarded.prefill.start().wait_healthy(timeout_s=420)

    outcome = late_legs(
        guarded,
        expected,
        wait_s=0,
        between=restart,
    )
    outcome.assert_guarded()
    assert guarded.decode.log_text().count("the prefill engine restarted") >= 4


@pytest.mark.slow  # ~40 s on two cores: not in .ci/run (docs/testing.md)
def test_decode_legs_later_than_the_default_lease_fail_loudly(
    guarded: PdPair, expected: dict[str, str]
) -> None:
    """vLLM's default lease (30 s): decode legs 36 s after their prefill legs, churn between."""
    before = guarded.decode.log_text().count("(lease 30 s)")
    outcome = late_legs(guarded, expected, wait_s=36)
    outcome.assert_guarded()
    assert guarded.decode.log_text().count("(lease 30 s)") >= before + 4


def test_the_router_reruns_a_refused_request_on_a_fresh_prefill(
    guarded: PdPair, expected: dict[str, str], expiring: EngineProcess
) -> None:
    """Two prefill engines, the first with a lease that is over before any decode can pin
    it: the router's first attempt is refused, its re-run on the other prefill answers
    correctly, and ``router_lease_reruns_total`` counts it."""
    expiring.wait_healthy(timeout_s=420)
    pool = BackendPool.from_urls(
        [expiring.spec.url, guarded.prefill.spec.url], [guarded.decode.spec.url]
    )
    with running_router(pool) as router_url:
        prompt = PROMPTS[0]
        with httpx.Client(timeout=120) as client:
            answer = client.post(f"{router_url}/v1/completions", json=body(guarded.model, prompt))
            metrics = client.get(f"{router_url}/metrics").text
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected[prompt]
        # Before 0.32 the decode engine computes the refused prompt itself: no re-run needed.
        reruns = 1 if compat.transfer_results_api() else 0
        assert sample_sum(metrics, "router_lease_reruns_total") == reruns
        assert engine_posts(expiring.spec.url) == 1
        assert "its lease expired" in guarded.decode.log_text()


def chat_text(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            for choice in payload["choices"]:
                text += choice["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_router_reruns_refused_chat_requests_streamed_or_not(
    guarded: PdPair, expiring: EngineProcess, stream: bool
) -> None:
    """Chat streams open with a role chunk before the decode engine loads the KV; a failed
    load follows it. The router reads past that chunk, so a refused chat request is re-run
    on the other prefill like a completion, and the client sees one clean answer."""
    expiring.wait_healthy(timeout_s=420)
    chat = {
        "model": guarded.model,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 12,
        "temperature": 0.0,
        "stream": stream,
    }
    with httpx.Client(timeout=120) as client:
        alone = client.post(f"{guarded.decode.spec.url}/v1/chat/completions", json=chat)
        expected = chat_text(alone, stream)
    pool = BackendPool.from_urls(
        [expiring.spec.url, guarded.prefill.spec.url], [guarded.decode.spec.url]
    )
    with running_router(pool) as router_url:
        posts_before = engine_posts(expiring.spec.url)
        with httpx.Client(timeout=120) as client:
            answer = client.post(f"{router_url}/v1/chat/completions", json=chat)
            metrics = client.get(f"{router_url}/metrics").text
        assert answer.status_code == 200, answer.text
        assert chat_text(answer, stream) == expected
        reruns = 1 if compat.transfer_results_api() else 0
        assert sample_sum(metrics, "router_lease_reruns_total") == reruns
        assert engine_posts(expiring.spec.url) == posts_before + 1
