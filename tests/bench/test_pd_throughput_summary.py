"""How ``bench.pd_throughput`` pools its runs: per (shape, concurrency, way) output tokens over
run time, percentiles over every request, the engines' stage means averaged over runs, the
P/D / alone ratio round by round, and a headline per shape at the highest concurrency."""

from __future__ import annotations

import math

import pytest

from bench.pd_throughput import summarize, table


def run(
    shape: str, way: str, concurrency: int, tokens: int, seconds: float, round_index: int
) -> dict:
    return {
        "shape": shape,
        "round": round_index,
        "concurrency": concurrency,
        "way": way,
        "output_tokens": tokens,
        "duration_s": seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttfts_ms": [10.0 * (round_index + 1), 30.0],
        "e2els_ms": [100.0, 200.0],
        "itl_p50_ms": 5.0 + round_index,
        "engine_stage_means_ms": {
            "prefill": {"ttft": 10.0 * (round_index + 1)},
            "decode": {"queue": 4.0, "ttft": 8.0},
        },
    }


def test_pooled_figures_round_ratios_and_headline_per_shape() -> None:
    runs = [
        run("tiny", "pd", 32, 600, 1.0, 0),
        run("tiny", "decode_alone", 32, 1000, 1.0, 0),
        run("tiny", "pd", 32, 800, 1.0, 1),
        run("tiny", "decode_alone", 32, 1000, 1.0, 1),
        run("tiny", "pd", 8, 500, 1.0, 0),  # lower concurrency: not in the headline
        run("tiny", "decode_alone", 8, 250, 1.0, 0),
        run("real_compute", "pd", 32, 360, 3.0, 0),
        run("real_compute", "decode_alone", 32, 100, 1.0, 0),
    ]
    result = summarize(runs)
    tiny = result["by_shape"]["tiny"]["32"]
    assert tiny["pd"]["output_tokens_per_s"] == pytest.approx(700.0)  # 1400 tokens over 2 s
    assert tiny["pd"]["engine_stage_means_ms"]["prefill"]["ttft"] == pytest.approx(15.0)
    assert tiny["pd"]["itl_p50_ms"] == pytest.approx(5.5)  # median of the runs' p50s
    assert tiny["pd"]["ttft_p50_ms"] == pytest.approx(25.0)  # over the four requests
    assert result["per_round_pd_vs_alone"]["tiny"]["32"] == pytest.approx([0.6, 0.8])
    assert result["headline"] == {
        "pd_vs_decode_alone_tokens_per_s_tiny": pytest.approx(0.7),
        "pd_vs_decode_alone_tokens_per_s_real_compute": pytest.approx(1.2),
    }
    rendered = table(result)
    assert "| real_compute | 32 | pd | 120 |" in rendered
    assert "| tiny | 32 | decode_alone | 1000 |" in rendered and "| nan | 4 | 8 |" in rendered
    assert rendered.count("\n") == 2 + 6 - 1  # header, rule, one row per shape/c/way


def test_a_shape_missing_a_way_has_no_headline() -> None:
    result = summarize([run("tiny", "pd", 32, 600, 1.0, 0)])
    assert result["headline"] == {}
    assert result["per_round_pd_vs_alone"]["tiny"]["32"] == []


def test_runs_without_a_figure_leave_it_out_of_the_pooled_one() -> None:
    with_figures = {
        **run("tiny", "pd", 32, 600, 1.0, 0),
        "engine_itl_p50_ms": 12.0,
        "decode_engine_steps": {"steps": 30.0, "generated_per_step": 20.0},
    }
    silent = {**run("tiny", "pd", 32, 600, 1.0, 1), "decode_engine_steps": {"steps": 0.0}}
    alone = [run("tiny", "decode_alone", 32, 1000, 1.0, i) for i in (0, 1)]
    pooled = summarize([with_figures, silent, *alone])["by_shape"]["tiny"]["32"]
    assert pooled["pd"]["engine_itl_p50_ms"] == 12.0  # the run without one is left out
    assert pooled["pd"]["decode_generated_per_step"] == 20.0
    assert math.isnan(pooled["decode_alone"]["engine_itl_p50_ms"])  # no run had one


def test_cpu_waits_are_per_1k_output_tokens_and_left_out_where_unrecorded() -> None:
    cpu = {"decode": {"run_s": 3.0, "wait_for_cpu_s": 1.2}, "router": {"run_s": 0.6}}
    recorded = {**run("tiny", "pd", 32, 600, 1.0, 0), "cpu_s": cpu}
    older = run("tiny", "pd", 32, 600, 1.0, 1)  # a run from before the figure existed
    alone = [run("tiny", "decode_alone", 32, 1000, 1.0, i) for i in (0, 1)]
    pooled = summarize([recorded, older, *alone])["by_shape"]["tiny"]["32"]
    assert pooled["pd"]["decode_wait_for_cpu_s_per_1k_tokens"] == pytest.approx(2.0)
    assert pooled["pd"]["router_cpu_s_per_1k_tokens"] == pytest.approx(1.0)
    assert math.isnan(pooled["decode_alone"]["decode_wait_for_cpu_s_per_1k_tokens"])
