"""``bench.short_prompts``: each way's median against the decode engine alone's, and the
figures it puts into ``latest.json``."""

from __future__ import annotations

import statistics

import pytest

from bench.short_prompts import WAYS, median_ratio_interval, ratios


def test_ratios_are_medians_against_the_decode_engine_alone() -> None:
    ttft = {way: [0.010, 0.012, 0.011] for way in WAYS}
    ttft["router_conditional"] = [0.013, 0.014, 0.012]
    ttft["router_pd"] = [0.030, 0.033, 0.040]
    figures = ratios(ttft)
    assert figures["ttft_median_s"]["decode_alone"] == pytest.approx(0.011)
    assert figures["conditional_vs_decode_alone_ttft"] == pytest.approx(13 / 11)
    assert figures["pd_vs_decode_alone_ttft"] == pytest.approx(33 / 11)
    assert figures["conditional_added_ms"] == pytest.approx(2.0)
    assert figures["passthrough_added_ms"] == pytest.approx(0.0)
    assert figures["ttft_p90_s"]["router_pd"] > figures["ttft_median_s"]["router_pd"]


def test_latest_keys_are_keyed_by_prompt_tokens() -> None:
    from bench.short_prompts import latest_keys

    ttft = {way: [0.010, 0.011] for way in WAYS}
    ttft["router_conditional"] = [0.012, 0.013]
    result = {
        "by_prompt_words": {"8": {"prompt_tokens": 25, **ratios(ttft)}},
        "date": "2026-12-07T00:00:00+00:00",
        "commit": "abc1234",
    }
    keys = latest_keys(result)
    assert keys["short_prompt_conditional_vs_decode_alone_ttft"] == {"25": round(12.5 / 10.5, 3)}
    assert keys["short_prompt_router_added_ms"] == {"25": 2.0}
    low, high = keys["short_prompt_conditional_vs_decode_alone_ttft_95ci"]["25"]
    assert low <= round(12.5 / 10.5, 3) <= high
    assert keys["short_prompts_commit"] == "abc1234"


def test_short_prompt_choices_count_only_that_reason() -> None:
    from bench.short_prompts import short_prompt_choices

    text = (
        'router_policy_choices_total{engine="a",reason="short_prompt",role="colocated"} 5.0\n'
        'router_policy_choices_total{engine="b",reason="short_prompt",role="colocated"} 2.0\n'
        'router_policy_choices_total{engine="a",reason="cached_prefix",role="colocated"} 9.0\n'
    )
    assert short_prompt_choices(text) == 7.0
    assert short_prompt_choices("") == 0.0


def test_the_ratio_interval_holds_the_ratio_and_narrows_with_more_requests() -> None:
    """Noisy, unproportional samples (each way's own scatter, as on a real machine)."""
    alone = [0.010 + 0.001 * (i % 7) for i in range(40)]
    router = [0.012 + 0.0013 * ((i * 3) % 5) for i in range(40)]
    ratio = statistics.median(router) / statistics.median(alone)
    low, high = median_ratio_interval(router, alone)
    assert low < ratio < high
    assert low > 1.0  # 40 requests a way tell this router from parity
    wide = median_ratio_interval(router[:8], alone[:8])
    assert wide[1] - wide[0] > 1.5 * (high - low)
    assert median_ratio_interval(router, alone) == (low, high)  # reproducible from the samples


def test_the_interval_pairs_rounds_so_a_drift_both_ways_share_cancels() -> None:
    """Both ways slow down together round by round (the machine drifting): paired rounds
    keep the ratio's interval tight around it; drawn independently it would be wide."""
    alone = [0.010 * (1 + i / 10) for i in range(40)]
    router = [t * 1.1 for t in alone]
    low, high = median_ratio_interval(router, alone)
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_ways_of_different_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="same number of rounds"):
        median_ratio_interval([0.01, 0.02], [0.01])


def test_ratios_carry_intervals_for_the_router_and_the_bare_relay() -> None:
    ttft = {way: [0.010, 0.012, 0.011, 0.013] for way in WAYS}
    figures = ratios(ttft)
    for key in ("conditional_vs_decode_alone_ttft_95ci", "passthrough_vs_decode_alone_ttft_95ci"):
        low, high = figures[key]
        assert low <= 1.0 <= high
