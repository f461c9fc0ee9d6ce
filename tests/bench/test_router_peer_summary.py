"""How ``bench.router_peer`` turns runs of ``vllm bench serve`` into its table and headline:
every round's requests pooled per (target, concurrency), the headline the worse of 8 and 32."""

from __future__ import annotations

import pytest

from bench.router_peer import (
    TARGETS,
    hit_shares,
    percentile,
    refresh_latest,
    run_seed,
    summarize,
    table,
)


def run(
    target: str,
    concurrency: int,
    ttfts: list[float],
    tokens: int,
    seconds: float,
    round_index: int = 0,
) -> dict:
    return {
        "round": round_index,
        "target": target,
        "output_tokens_per_s": tokens / seconds,
        "ttft_p99_ms": percentile(ttfts, 99),
        "concurrency": concurrency,
        "duration_s": seconds,
        "output_tokens": tokens,
        "ttfts_ms": ttfts,
        "e2els_ms": [t + 100 for t in ttfts],
        "router_cpu_s_per_request": 0.002 if target != "decode_alone" else None,
    }


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([10.0, 20.0], 50) == pytest.approx(15.0)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert percentile([5.0], 99) == 5.0


def test_rounds_are_pooled_not_averaged() -> None:
    """Two rounds of 100 requests: one quiet, one with two stalled requests; the pooled p99
    weighs the stalls at their real share (2 in 200, not 2 in 100), and throughput is tokens
    over the summed run time."""
    quiet = [100.0] * 100
    stalled = [100.0] * 98 + [3000.0] * 2
    runs = [
        run("ours", 8, quiet, 3200, 4.0),
        run("ours", 8, stalled, 3200, 12.0, round_index=1),
        run("vllm_router", 8, quiet, 3200, 8.0),
        run("vllm_router", 8, quiet, 3200, 8.0, round_index=1),
    ]
    result = summarize(runs)
    ours = result["by_concurrency"]["8"]["ours"]
    assert ours["output_tokens_per_s"] == pytest.approx(6400 / 16.0)
    assert ours["requests"] == 200
    # rank 0.99 * 199 = 197.01: 1% of the way from the last quiet request to the first stall
    assert ours["ttft_p99_ms"] == pytest.approx(100.0 + 0.01 * 2900.0)
    assert ours["router_cpu_ms_per_request"] == pytest.approx(2.0)
    # only concurrency 8 ran: the headline is that one's ratio
    assert result["headline"]["router_vs_vllm_router_throughput"] == pytest.approx(1.0)


def test_headline_is_the_worse_of_8_and_32() -> None:
    runs = [
        run("ours", 8, [100.0] * 10, 1000, 1.0),
        run("vllm_router", 8, [200.0] * 10, 1000, 2.0),
        run("ours", 32, [300.0] * 10, 1000, 4.0),
        run("vllm_router", 32, [200.0] * 10, 1000, 2.0),
        run("ours", 1, [900.0] * 10, 10, 10.0),  # concurrency 1 is reported, not a headline
        run("vllm_router", 1, [100.0] * 10, 100, 1.0),
    ]
    headline = summarize(runs)["headline"]
    assert headline["router_vs_vllm_router_throughput"] == pytest.approx(0.5)
    assert headline["router_vs_vllm_router_p99_ttft"] == pytest.approx(1.5)
    assert headline["router_vs_vllm_router_p50_ttft"] == pytest.approx(1.5)
    assert "pd_vs_decode_alone_tokens_per_s" not in headline  # the decode engine never ran


def test_pd_against_the_decode_engine_alone_is_the_worse_of_8_and_32() -> None:
    """``pd_vs_decode_alone_tokens_per_s`` (issue 34's goal: at least 1.0): our router's P/D
    throughput over the decode engine's serving alone, per concurrency, the lower one."""
    runs = [
        run("ours", 8, [100.0] * 10, 1000, 1.0),
        run("decode_alone", 8, [50.0] * 10, 1000, 0.8),
        run("ours", 32, [100.0] * 10, 1000, 2.0),
        run("decode_alone", 32, [50.0] * 10, 1000, 1.0),
        run("ours", 1, [100.0] * 10, 10, 10.0),
        run("decode_alone", 1, [100.0] * 10, 100, 1.0),
    ]
    result = summarize(runs)
    assert result["headline"]["pd_vs_decode_alone_tokens_per_s"] == pytest.approx(0.5)
    assert "router_vs_vllm_router_throughput" not in result["headline"]  # no peer ran


def test_every_run_of_a_benchmark_draws_its_own_prompts() -> None:
    seeds = [
        run_seed(r, c, t)
        for r in range(10)
        for c in (1, 2, 8, 32, 128)
        for t in range(len(TARGETS))
    ]
    assert len(set(seeds)) == len(seeds)


def test_hit_share_is_per_run_and_none_for_an_engine_that_saw_no_prompt() -> None:
    before = {"prefill": (1000.0, 4000.0), "decode": (50.0, 100.0)}
    after = {"prefill": (1300.0, 5000.0), "decode": (50.0, 100.0)}
    assert hit_shares(before, after) == {"prefill": pytest.approx(0.3), "decode": None}


def test_each_round_pairs_ours_with_the_peer_of_the_same_round() -> None:
    """Round 0: ours twice the peer's throughput; round 1: half of it, with a stall. The
    pooled throughput hides that the rounds disagree; the per-round ratios show it."""
    runs = [
        run("ours", 8, [100.0] * 10, 1000, 1.0),
        run("vllm_router", 8, [100.0] * 10, 1000, 2.0),
        run("decode_alone", 8, [10.0] * 10, 1000, 0.5),
        run("vllm_router", 8, [100.0] * 10, 1000, 2.0, round_index=1),
        run("ours", 8, [100.0] * 9 + [400.0], 1000, 4.0, round_index=1),
        run("ours", 32, [100.0] * 10, 1000, 1.0),  # its peer never ran: no pair
    ]
    result = summarize(runs)
    per_round = result["per_round"]
    assert list(per_round) == ["8"]
    assert per_round["8"]["throughput"] == pytest.approx([2.0, 0.5])
    assert per_round["8"]["p99_ttft"][0] == pytest.approx(1.0)
    assert per_round["8"]["p99_ttft"][1] > 3.0
    assert per_round["8"]["p50_ttft"] == pytest.approx([1.0, 1.0])  # one stall moves no median
    assert "| 8 | 2.00 0.50 | 1.00 " in table(result)


def test_a_section_refreshes_its_keys_in_latest_and_keeps_the_others(tmp_path) -> None:
    import json

    latest = tmp_path / "latest.json"
    latest.write_text(json.dumps({"register_ratio": 1.5, "router_vs_vllm_router_throughput": 0.9}))
    refresh_latest({"router_vs_vllm_router_throughput": 1.1}, latest)
    found = json.loads(latest.read_text())
    assert found["register_ratio"] == 1.5  # another section's key stays
    assert found["router_vs_vllm_router_throughput"] == 1.1
    assert found["router_peer_date"].startswith("20") and len(found["router_peer_commit"]) >= 7
    refresh_latest({"goodput_pd_rps": 2.0}, latest, section="goodput")
    assert json.loads(latest.read_text())["goodput_commit"] == found["router_peer_commit"]
