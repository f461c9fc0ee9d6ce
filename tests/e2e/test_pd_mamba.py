"""A Mamba2 hybrid (tiny NemotronH: Mamba2 and attention layers) through P/D with
HybridNixlConnector: real ``vllm serve`` engines started by our launcher, which sets what
Mamba P/D needs (VLLM_SSM_CONV_STATE_LAYOUT=DS; prefix caching off on vLLM's CPU build).
Greedy answers must equal the prefill engine answering alone, token for token, with the
prompt's state read over NIXL; configurations that would die or corrupt are refused by name.

The one allowance (a near tie after vLLM's prefill backoff) is explained in
``tests/e2e/mamba_answers.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.digest_injection import (
    ARMED_LINE,
    VERIFIED_LINE,
    hooked_env,
    run_injected,
    run_uncaught_damage,
)
from tests.e2e.lease_scenario import expected_texts, late_legs
from tests.e2e.mamba_answers import PROMPTS, assert_same_answer, body
from tests.e2e.pd_fixture import (
    PdPair,
    run_pd_and_colocated,
    running_router,
    start_pair,
)
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess
from vllm_hybrid_nixl.deploy.pd_client import prefill_body
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tiny_mamba_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    # A short lease, for the late-leg test; the other tests send their legs at once. Both
    # engines carry the (idle) KV corruption hook for the digest tests.
    logs = tmp_path_factory.mktemp("mamba-logs")
    prefill = {"kv_extra_config": {"kv_lease_duration": 3}, "env": hooked_env(logs / "p.json")}
    decode = {"env": hooked_env(logs / "d.json")}
    yield from start_pair(tiny_mamba_model, logs, prefill, decode)


@pytest.fixture(scope="module")
def router_url(pair: PdPair) -> Iterator[str]:
    with running_router(
        BackendPool.from_urls([pair.prefill.spec.url], [pair.decode.spec.url])
    ) as url:
        yield url


def _same(pd: dict, colocated: dict) -> bool:
    try:
        assert_same_answer(pd, colocated)
    except AssertionError:
        return False
    return True


DIGEST_BODIES = 10  # per place of injection: 20 corrupted reads per group kind


def _digest_bodies(pair: PdPair, tag: str) -> list[dict]:
    return [body(pair.model, f"{tag} {i}: " + PROMPTS[i % 4]) for i in range(DIGEST_BODIES)]


@pytest.mark.parametrize("where", ["received", "source"])
@pytest.mark.parametrize("kind", ["mamba", "full_attention"])
def test_every_corrupted_kv_read_is_caught_and_rerun(
    pair: PdPair, router_url: str, kind: str, where: str
) -> None:
    """One flipped byte in the Mamba state or an attention page — in the pages the decode
    engine received, or in the prefill's pages after they were digested — fails the read;
    the router re-runs it and the client gets the colocated answer (0 wrong)."""
    assert ARMED_LINE in pair.decode.log_text()
    run_injected(pair, router_url, _digest_bodies(pair, where + kind), where, kind, _same)
    assert VERIFIED_LINE in pair.decode.log_text()  # the re-runs read verified KV


@pytest.mark.parametrize("kind", ["mamba", "full_attention"])
def test_the_same_damage_unchecked_answers_wrong_tokens(pair: PdPair, kind: str) -> None:
    """The negative control: the received pages overwritten after the check (as if nothing
    verified them) answer HTTP 200 with other tokens. Compared token for token: the near-tie
    allowance of the tests above would let a random-weight model's wrong answer pass."""
    same = run_uncaught_damage(
        pair, _digest_bodies(pair, "unchecked " + kind)[:3], kind, _same_tokens
    )
    assert not any(same), same


def _same_tokens(pd: dict, colocated: dict) -> bool:
    return pd["token_ids"] == colocated["token_ids"]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["lighthouse", "mamba", "short", "ships"])
def test_mamba_pd_equals_colocated_and_the_state_came_over_nixl(pair: PdPair, prompt) -> None:
    run = run_pd_and_colocated(pair, body(pair.model, prompt))
    assert_same_answer(run.pd_choice, run.colocated_choice)
    assert run.moved.nixl_bytes > 0 and run.moved.failed_transfers == 0
    # vLLM's decoder recomputes the last prompt token for Mamba (its prefill backoff)
    assert run.moved.external_prompt_tokens >= run.prompt_tokens - 1


def test_the_tolerance_tells_another_prompts_state_apart(pair: PdPair) -> None:
    """The negative control of the comparison above: P/D of one prompt against the
    colocated answer of another (same length) must not pass as the same answer."""
    first = run_pd_and_colocated(pair, body(pair.model, PROMPTS[0]))
    other = {**body(pair.model, PROMPTS[0].replace("lighthouse", "harbour"))}
    with httpx.Client(timeout=120) as client:
        alone = client.post(f"{pair.prefill.spec.url}/v1/completions", json=other).json()
    with pytest.raises(AssertionError):
        assert_same_answer(first.pd_choice, alone["choices"][0])


def test_a_late_decode_leg_is_refused_for_mamba_state_too(pair: PdPair) -> None:
    """The lease guard on Mamba state: decode legs sent after the 3 s lease, churn between."""
    expected = expected_texts(pair.decode.spec.url, pair.model)
    outcome = late_legs(pair, expected, wait_s=5)
    outcome.assert_guarded()
    assert pair.decode.log_text().count("its lease expired") >= 4


def test_the_launcher_set_what_mamba_pd_needs(pair: PdPair) -> None:
    for engine in (pair.prefill, pair.decode):
        environ = Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0")
        assert b"VLLM_SSM_CONV_STATE_LAYOUT=DS" in environ
        cmdline = Path(f"/proc/{engine.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--no-enable-prefix-caching" in cmdline
    assert "validated" in pair.decode.log_text()


def test_mamba_pd_through_the_router(pair: PdPair) -> None:
    pool = BackendPool.from_urls([pair.prefill.spec.url], [pair.decode.spec.url])
    router = RouterServer(pool, "127.0.0.1", free_port()).start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if httpx.get(f"{router.url}/health", timeout=30).status_code == 200:
                break
            time.sleep(0.5)
        with httpx.Client(timeout=120) as client:
            for prompt in PROMPTS[:2]:
                routed = client.post(f"{router.url}/v1/completions", json=body(pair.model, prompt))
                alone = client.post(
                    f"{pair.prefill.spec.url}/v1/completions", json=body(pair.model, prompt)
                )
                assert routed.status_code == 200, routed.text
                assert_same_answer(routed.json()["choices"][0], alone.json()["choices"][0])
    finally:
        router.stop()


def test_engines_with_different_ssm_state_dtypes_are_refused_by_name(
    pair: PdPair, tmp_path: Path
) -> None:
    """A decode engine whose SSM state is bf16 would read the prefill's float32 state as
    garbage: its handshake refuses, naming the state field, and the router never pairs the
    two (503, the field in /health). It takes the place of the
    pair's decode engine (the tests after this one need none)."""
    pair.decode.stop()
    spec = dataclasses.replace(
        pair.decode.spec,
        port=free_port(),
        side_channel_port=free_side_channel_port(),
        extra_args=[*pair.decode.spec.extra_args, "--mamba-ssm-cache-dtype", "bfloat16"],
    )
    decode = EngineProcess(spec, tmp_path / "decode-bf16.log").start()
    try:
        decode.wait_healthy(timeout_s=420)
        with httpx.Client(timeout=120) as client:
            params = client.post(
                f"{pair.prefill.spec.url}/v1/completions",
                json=prefill_body(body(pair.model, PROMPTS[0])),
            ).json()["kv_transfer_params"]
            answer = client.post(
                f"{spec.url}/v1/completions",
                json={**body(pair.model, PROMPTS[0]), "kv_transfer_params": params},
            )
        assert answer.status_code >= 400
        log = decode.log_text()
        assert "KV-cache" in log and ".state:" in log and "mamba-ssm-cache-dtype" in log
        # The router reads both fingerprints and never pairs them.
        pool = BackendPool.from_urls(
            [pair.prefill.spec.url],
            [spec.url],
            [pair.prefill.spec.side_channel],
            [spec.side_channel],
        )
        router = RouterServer(pool, "127.0.0.1", free_port()).start()
        try:
            problems: list = []
            deadline = time.monotonic() + 60
            while not problems and time.monotonic() < deadline:
                problems = httpx.get(f"{router.url}/health", timeout=30).json()["pairing_problems"]
                time.sleep(0.5)
            assert problems and ".state" in str(problems), problems
            refused = httpx.post(
                f"{router.url}/v1/completions", json=body(pair.model, PROMPTS[0]), timeout=60
            )
            assert refused.status_code == 503, refused.text
        finally:
            router.stop()
    finally:
        decode.stop()


def test_prefix_caching_on_a_mamba_model_is_refused_at_start_up(
    pair: PdPair, tmp_path: Path
) -> None:
    """vLLM's CPU build would start this engine and die at its first long prompt. Runs last:
    it stops the pair's prefill engine first, so the refused one starts on a quiet machine."""
    pair.prefill.stop()
    spec = dataclasses.replace(
        pair.prefill.spec,
        port=free_port(),
        side_channel_port=free_side_channel_port(),
        extra_args=[*pair.prefill.spec.extra_args, "--enable-prefix-caching"],
    )
    engine = EngineProcess(spec, tmp_path / "refused.log").start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "refuses to start" not in engine.log_text():
            time.sleep(1)
        log = engine.log_text()
        assert "vllm-hybrid-nixl refuses to start this engine" in log
        assert "--no-enable-prefix-caching" in log
    finally:
        engine.stop()
