"""The r != 1 case through vLLM's own read path: real ``vllm serve`` engines whose attention
kernel runs on 32-token blocks while ``--block-size`` is 64 (r = 2), so every cache is
``[NB*2, PS/2]`` and vLLM's block tables, cache views and NIXL descriptors follow.

The kernel block size is the one thing faked (``tests/harness/kernel_block_hook``: on CPU the
attention backend accepts any multiple of 16/32, a GPU kernel would fix it); the attention
itself really computes on 32-token blocks, colocated and P/D alike. The sliding-window hybrid
runs here with our connector and with the stock one beside it, on every release of the
version matrix. (A Mamba hybrid is not run with r != 1: under the same hook vLLM 0.32.0's CPU
build alone, without any connector, answers a repeated prompt with NaN logits, so there is no
colocated reference; see README "Hybrid kinds".)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.pd_fixture import (
    WORKER_LINE,
    PdPair,
    assert_stock_refuses_at_start_up,
    run_pd_and_colocated,
    start_pair,
)
from tests.harness.kernel_block_hook import HOOK_LINE, engine_env
from tests.harness.releases import stock_is_strict

pytestmark = pytest.mark.e2e

KERNEL_BLOCK = 32  # with --block-size 64: r = 2
PROMPTS = {
    "short": "the decode engine reads the kv cache",
    # 228 tokens: past the 64-token sliding window, four 64-token blocks, eight kernel blocks.
    "multi-block": " ".join(["the prefill engine computes every layer of the hybrid model"] * 12),
}


def pair_with(connector: str, model, log_dir) -> Iterator[PdPair]:
    side = {"connector": connector, "env": engine_env(KERNEL_BLOCK)}
    yield from start_pair(model, log_dir, dict(side), dict(side))


@pytest.fixture(scope="module")
def ours(tiny_hybrid_model, tmp_path_factory) -> Iterator[PdPair]:
    yield from pair_with("HybridNixlConnector", tiny_hybrid_model, tmp_path_factory.mktemp("r2"))


def assert_pd_equals_colocated(pair: PdPair, prompt: str) -> None:
    body = {"model": pair.model, "prompt": prompt, "max_tokens": 20, "temperature": 0.0}
    run = run_pd_and_colocated(pair, body)
    assert run.pd_choice["text"] == run.colocated_choice["text"]
    assert run.colocated_choice["text"]  # 20 tokens of text, not an empty answer
    assert run.moved.external_prompt_tokens >= run.prompt_tokens - 1
    assert run.moved.nixl_bytes > 0 and run.moved.failed_transfers == 0


def test_the_stock_connector_with_r_2(tiny_hybrid_model, tmp_path_factory) -> None:
    """What stock NixlConnector does with the same engines, per release (recorded in the
    README): 0.24-0.25 refuse vLLM's CPU cache at start-up (their strict block-count check);
    0.27.1 and 0.32.0 serve it and their P/D answers equal colocated too. Runs first, before
    our pair is up: four engines on two cores start very slowly."""
    log_dir = tmp_path_factory.mktemp("r2-stock")
    if stock_is_strict():
        assert_stock_refuses_at_start_up(
            tiny_hybrid_model, log_dir / "stock.log", engine_env(KERNEL_BLOCK)
        )
        return
    stock = pair_with("NixlConnector", tiny_hybrid_model, log_dir)
    pair = next(stock)
    try:
        assert f"{HOOK_LINE} {KERNEL_BLOCK}" in pair.decode.log_text()
        for prompt in PROMPTS.values():
            assert_pd_equals_colocated(pair, prompt)
    finally:
        stock.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_engines_run_on_kernel_blocks_and_our_worker_sees_r_2(ours: PdPair, side: str) -> None:
    log = getattr(ours, side).log_text()
    assert f"{HOOK_LINE} {KERNEL_BLOCK}" in log
    lines = list(WORKER_LINE.finditer(log))
    assert len(lines) == 1, f"expected one registration line in {getattr(ours, side).log_path}"
    assert (lines[0]["r"], lines[0]["forms"], lines[0]["groups"]) == ("2", "physical", "2")


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_ours_with_r_2_equals_colocated_and_kv_came_over_nixl(ours: PdPair, prompt: str) -> None:
    assert_pd_equals_colocated(ours, prompt)
