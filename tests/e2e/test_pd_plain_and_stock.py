"""A plain (non-hybrid) model through HybridNixlConnector, and the stock NixlConnector as the
contrast, on whichever vLLM release is installed (the version matrix runs this module on
each).

On vLLM 0.24-0.25 the stock connector cannot start on vLLM's CPU build at all: its strict
block-count check takes dim 0 of the CPU cache ``[NB, H, B, 2*D]`` for K/V and raises. Ours
registers the same cache and serves P/D. On later releases both start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.pd_fixture import (
    PdPair,
    assert_stock_refuses_at_start_up,
    run_pd_and_colocated,
    start_pair,
    stock_engine_spec,
)
from tests.harness.releases import stock_is_strict
from vllm_hybrid_nixl.deploy.engines import EngineProcess
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec(arch="llama"))


def test_stock_connector_on_the_same_model(plain_model: Path, tmp_path: Path) -> None:
    """Strict releases: the stock connector dies at start-up (the contrast). Others: it serves.

    Runs first in the module, before the P/D pair is up: three engines on two cores start
    slowly here (every NIXL agent's progress thread spins a core)."""
    if stock_is_strict():
        assert_stock_refuses_at_start_up(plain_model, tmp_path / "stock.log", {})
        return
    spec = stock_engine_spec(plain_model)
    engine = EngineProcess(spec, tmp_path / "stock.log").start()
    try:
        engine.wait_healthy(timeout_s=600)
        assert httpx.get(f"{spec.url}/health", timeout=10).status_code == 200
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def pair(plain_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(
        plain_model,
        tmp_path_factory.mktemp("plain-pd-logs"),
        prefill={"connector": "HybridNixlConnector"},
        decode={"connector": "HybridNixlConnector"},
    )


def test_plain_model_pd_equals_colocated_and_kv_came_over_nixl(pair: PdPair) -> None:
    body = {
        "model": pair.model,
        "prompt": " ".join(["a plain model has one kv cache group"] * 20),
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    run = run_pd_and_colocated(pair, body)
    routed = run.pd_choice["token_ids"]
    assert routed == run.colocated_choice["token_ids"] and len(routed) == 16
    assert run.moved.external_prompt_tokens >= run.prompt_tokens - 1
    assert run.moved.nixl_bytes > 0 and run.moved.failed_transfers == 0
