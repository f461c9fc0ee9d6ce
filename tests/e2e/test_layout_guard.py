"""Engines whose KV-cache layouts differ never exchange KV: refused at handshake and by the
router, with the differing fields and both values named. And the negative controls of the
lease guard and of the batch checks: vLLM's stock NixlConnector on both engines answers a
late decode leg, and a prompt list, with HTTP 200 and wrong tokens (if that ever stops,
``test_lease_guard`` and ``test_integrity`` no longer show that our guards are what prevent it).

Real ``vllm serve`` processes on 127.0.0.1, real NIXL side channels, started together once:
a prefill engine at block size 64 with HybridNixlConnector, a decode engine at block size 32
with HybridNixlConnector, and a prefill (3 s lease) and a decode engine at 64 with vLLM's
stock NixlConnector, both with a 96-block cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.lease_scenario import body, expected_texts, late_legs
from tests.e2e.pd_fixture import COMMON_ARGS, PdPair, running_router
from tests.harness.releases import STOCK_REFUSAL, stock_is_strict
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec, stop_engines
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion, prefill_body
from vllm_hybrid_nixl.protocol.fingerprint import decode as decode_fingerprint
from vllm_hybrid_nixl.protocol.handshake_probe import fetch_compat_string
from vllm_hybrid_nixl.router import BackendPool

pytestmark = pytest.mark.e2e
PP = compat.side_channel_wants_pp_rank()  # the engines run this process's vLLM

SMALL_CACHE = ["--num-gpu-blocks-override", "96"]  # the stock pair: churn reuses blocks
PROMPT = " ".join(["a prompt long enough to fill more than one kv cache block"] * 8)


@dataclass
class Engines:
    prefill_64: EngineProcess
    decode_32: EngineProcess
    stock_prefill_64: EngineProcess
    stock_decode_64: EngineProcess
    model: str


def _args_with_block_size(block_size: int) -> list[str]:
    args = list(COMMON_ARGS)
    args[args.index("--block-size") + 1] = str(block_size)
    return args


@pytest.fixture(scope="module")
def engines(tiny_hybrid_model, tmp_path_factory) -> Iterator[Engines]:
    logs = tmp_path_factory.mktemp("layout-guard-logs")
    plan = [
        ("prefill_64", "prefill", "HybridNixlConnector", 64, 0),
        ("decode_32", "decode", "HybridNixlConnector", 32, 1),
        ("stock_prefill_64", "prefill", "NixlConnector", 64, 0),
        ("stock_decode_64", "decode", "NixlConnector", 64, 1),
    ]
    started: dict[str, EngineProcess] = {}
    try:
        for name, role, connector, block_size, core in plan:
            stock = connector == "NixlConnector"
            spec = EngineSpec(
                model=str(tiny_hybrid_model),
                port=free_port(),
                role=role,
                side_channel_port=free_side_channel_port(),
                cpu_core=core,
                connector=connector,
                extra_args=_args_with_block_size(block_size) + (SMALL_CACHE if stock else []),
                # the late-leg control: a lease over before the decode legs come
                kv_extra_config={"kv_lease_duration": 3} if stock and role == "prefill" else {},
            )
            started[name] = EngineProcess(spec, logs / f"{name}.log").start()
        for engine in started.values():
            engine.wait_healthy(timeout_s=420)
        yield Engines(**started, model=str(tiny_hybrid_model))
    finally:
        stop_engines(started.values())


def _body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}


def test_side_channels_advertise_fingerprints_and_the_stock_hash(engines: Engines) -> None:
    ours = decode_fingerprint(
        fetch_compat_string("127.0.0.1", engines.prefill_64.spec.side_channel_port, with_pp_rank=PP)
    )
    assert ours.block_size == 64 and len(ours.groups) == 2
    theirs = decode_fingerprint(
        fetch_compat_string("127.0.0.1", engines.decode_32.spec.side_channel_port, with_pp_rank=PP)
    )
    assert theirs.block_size == 32
    stock = fetch_compat_string(
        "127.0.0.1", engines.stock_prefill_64.spec.side_channel_port, with_pp_rank=PP
    )
    assert len(stock) == 64 and int(stock, 16) >= 0  # vLLM's plain hex digest


def test_block_size_mismatch_fails_at_handshake_naming_both_values(engines: Engines) -> None:
    with httpx.Client(timeout=120.0) as client:
        before = read_kv_transfer_counters(engines.decode_32.spec.url, client)
        with pytest.raises(LegError) as failure:
            disaggregated_completion(
                client,
                engines.prefill_64.spec.url,
                engines.decode_32.spec.url,
                _body(engines.model),
            )
        moved = read_kv_transfer_counters(engines.decode_32.spec.url, client) - before
    assert str(failure.value).startswith("decode leg")  # no answer, so no wrong answer
    assert moved.nixl_bytes == 0
    log = engines.decode_32.log_text()
    assert "vllm-hybrid-nixl refused KV transfer with prefill engine" in log
    assert "groups[0].block_size: decode (this engine) 32, prefill 64" in log
    assert "--block-size" in log


def test_stock_connector_peer_is_refused_with_the_connector_named(engines: Engines) -> None:
    with httpx.Client(timeout=120.0) as client, pytest.raises(LegError) as failure:
        disaggregated_completion(
            client,
            engines.stock_prefill_64.spec.url,
            engines.decode_32.spec.url,
            _body(engines.model),
        )
    assert str(failure.value).startswith("decode leg")
    log = engines.decode_32.log_text()
    assert "runs vLLM's stock NixlConnector" in log
    assert "allow_stock_peer" in log


@pytest.fixture(scope="module")
def mismatched_router(engines: Engines) -> Iterator[str]:
    pool = BackendPool.from_urls(
        [engines.prefill_64.spec.url],
        [engines.decode_32.spec.url],
        [engines.prefill_64.spec.side_channel],
        [engines.decode_32.spec.side_channel],
    )
    with running_router(pool, layouts=True) as url:
        yield url


def test_router_health_reports_the_incompatible_pair(mismatched_router: str) -> None:
    response = httpx.get(f"{mismatched_router}/health", timeout=30.0)
    assert response.status_code == 503
    health = response.json()
    assert health["status"] == "unavailable"
    assert all(engine["up"] for engine in health["engines"])
    assert "block_size=64" in health["engines"][0]["layout"]
    (problem,) = health["pairing_problems"]
    assert "groups[0].block_size: decode-0 32, prefill-0 64" in problem


def test_router_refuses_requests_without_touching_an_engine(
    engines: Engines, mismatched_router: str
) -> None:
    with httpx.Client(timeout=60.0) as client:
        before = read_kv_transfer_counters(engines.decode_32.spec.url, client)
        response = client.post(f"{mismatched_router}/v1/completions", json=_body(engines.model))
        after = read_kv_transfer_counters(engines.decode_32.spec.url, client)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "incompatible_engines"
    assert "block_size" in error["message"] and "--block-size" in error["message"]
    assert after.external_prompt_tokens == before.external_prompt_tokens


@pytest.fixture(scope="module")
def stock_pair(engines: Engines) -> PdPair:
    """On 0.24-0.25 the stock connector cannot start on vLLM's CPU build at all (shown by
    test_pd_plain_and_stock), so there is no stock P/D to corrupt: skipped there, by name."""
    if stock_is_strict():
        pytest.skip(
            "vLLM's stock NixlConnector does not start on this release's CPU build "
            f"({STOCK_REFUSAL}); the negative control needs a release where it serves"
        )
    return PdPair(engines.stock_prefill_64, engines.stock_decode_64, engines.model)


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
