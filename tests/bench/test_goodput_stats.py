"""What ``bench.goodput`` reports is computed right: SLO attainment, goodput, the crossover
rate, quantiles from Prometheus histogram buckets and compute per byte of KV."""

from __future__ import annotations

import math

import pytest

from bench.goodput import (
    ITL_METRIC,
    WORKLOADS,
    arrivals,
    bench_model_spec,
    model_shape,
    parse_scrape,
    sample_of,
    step_figures,
)
from bench.goodput_stats import (
    LLAMA3_8B,
    Sample,
    attainment,
    crossover_rate,
    goodput_rate,
    histogram_delta,
    histogram_quantile,
    mean_delta,
    summed_buckets,
)

pytestmark = pytest.mark.bench


def test_attainment_needs_both_slos_and_counts_unfinished_requests_as_misses() -> None:
    samples = [
        Sample(1.0, 0.02, 0.10),  # within both
        Sample(5.0, 0.02, 0.10),  # first token too late
        Sample(1.0, 0.02, 0.90),  # a stall between tokens
        Sample(None),  # never finished
    ]
    assert attainment(samples, ttft_slo_s=2.0, gap_slo_s=0.3) == 0.25
    assert math.isnan(attainment([], 2.0, 0.3))
    assert not Sample(None).finished and Sample(1.0, 0.01, 0.0).finished


def test_goodput_is_the_highest_rate_before_the_first_miss() -> None:
    points = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.5), (4.0, 0.92)]  # a late recovery is noise
    assert goodput_rate(points) == 2.0
    assert goodput_rate([(1.0, 0.5)]) == 0.0
    assert goodput_rate([(2.0, 0.9), (1.0, 1.0)]) == 2.0  # order of the points does not matter


def test_crossover_interpolates_where_the_lead_changes_and_skips_ties() -> None:
    rates = [1.0, 2.0, 3.0, 4.0]
    # colocated leads at 1, both tie at 2, P/D leads from 3 on: between 1 and 3
    assert crossover_rate(rates, [0.8, 0.9, 1.0, 1.0], [1.0, 0.9, 0.6, 0.2]) == pytest.approx(
        1.0 + 2.0 * 0.2 / 0.6
    )
    assert crossover_rate(rates, [1.0] * 4, [0.5] * 4) is None  # one way leads throughout
    assert crossover_rate(rates, [1.0] * 4, [1.0] * 4) is None  # all ties
    nan = float("nan")  # a rate a way has no figure for is skipped, not read as a lead
    assert crossover_rate(rates, [nan, 0.5, 1.0, 1.0], [1.0, 1.0, 0.5, 0.5]) == pytest.approx(2.5)


def test_histogram_quantiles_interpolate_inside_the_bucket() -> None:
    before = {0.01: 0.0, 0.02: 0.0, 0.05: 0.0, math.inf: 0.0}
    after = {0.01: 10.0, 0.02: 90.0, 0.05: 100.0, math.inf: 100.0}
    delta = histogram_delta(before, after)
    assert histogram_quantile(delta, 0.5) == pytest.approx(0.01 + 0.01 * 40 / 80)
    assert histogram_quantile(delta, 0.99) == pytest.approx(0.02 + 0.03 * 9 / 10)
    assert math.isnan(histogram_quantile({0.01: 0.0, math.inf: 0.0}, 0.5))
    overflow = {0.01: 1.0, math.inf: 10.0}  # beyond the last finite bound: that bound
    assert histogram_quantile(overflow, 0.99) == 0.01
    assert summed_buckets([{0.01: 1.0, math.inf: 2.0}, {0.01: 3.0, math.inf: 3.0}]) == {
        0.01: 4.0,
        math.inf: 5.0,
    }
    assert mean_delta((1.0, 2.0), (4.0, 5.0)) == 1.0 and math.isnan(mean_delta((1, 1), (1, 1)))


def test_the_bench_model_has_a_real_models_compute_per_byte_of_kv() -> None:
    ours, llama = model_shape(bench_model_spec()).flops_per_kv_byte, LLAMA3_8B.flops_per_kv_byte
    assert 100_000 < llama < 110_000  # 436 MFLOPs per token per layer over 4 KiB of KV
    assert 0.5 < ours / llama < 2.0  # same order: not a toy's few hundred FLOPs per byte


def test_arrivals_are_seeded_poisson_with_lengths_in_range() -> None:
    workload = WORKLOADS["prefill_heavy"]
    first = arrivals(workload, 2.0, 200, seed=5, vocab=400)
    assert first == arrivals(workload, 2.0, 200, seed=5, vocab=400)  # same seed, same stream
    gaps = [b.at_s - a.at_s for a, b in zip(first, first[1:], strict=False)]
    assert all(g > 0 for g in gaps) and 0.35 < sum(gaps) / len(gaps) < 0.65  # mean 1/rate
    low, high = workload.prompt_tokens
    assert all(low <= len(r.prompt) <= high for r in first)
    assert all(workload.output_tokens[0] <= r.output_tokens <= workload.output_tokens[1]
               for r in first)  # fmt: skip
    assert all(3 <= t < 400 for r in first[:5] for t in r.prompt)
    assert len({tuple(r.prompt[:64]) for r in first}) == len(first)  # no shared first block


def test_a_stream_counts_only_when_every_requested_token_came() -> None:
    seen = [0.5, 0.52, 0.9, 0.92]  # first token at 0.5 s, one 0.38 s stall
    sample = sample_of(seen, tokens=4, wanted=4)
    assert sample.ttft_s == 0.5 and sample.max_gap_s == pytest.approx(0.38)
    assert sample.tpot_s == pytest.approx(0.42 / 3)
    assert not sample_of(seen, tokens=3, wanted=4).finished  # cut short: a miss
    assert sample_of(seen, tokens=None, wanted=4).finished  # no usage event: ignore_eos
    assert not sample_of([], tokens=4, wanted=4).finished


def test_metrics_of_two_label_sets_are_summed() -> None:
    text = "\n".join(
        [
            f"# HELP {ITL_METRIC} ITL",
            f"# TYPE {ITL_METRIC} histogram",
            *(
                f'{ITL_METRIC}_bucket{{engine="{e}",le="{le}"}} {n}'
                for e, counts in (("0", (1, 3)), ("1", (2, 2)))
                for le, n in zip(("0.01", "+Inf"), counts, strict=True)
            ),
            *(f'{ITL_METRIC}_{k}{{engine="{e}"}} {v}' for e in "01" for k, v in
              (("count", 3), ("sum", 0.1))),
            "# HELP vllm:request_queue_time_seconds queue",
            "# TYPE vllm:request_queue_time_seconds histogram",
            'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf"} 4',
            'vllm:request_queue_time_seconds_count{engine="0"} 4',
            'vllm:request_queue_time_seconds_sum{engine="0"} 2.0',
        ]
    )  # fmt: skip
    found = parse_scrape(text + "\n")
    assert found.itl == {0.01: 3.0, math.inf: 5.0}
    assert found.stages == {"queue": (2.0, 4.0)}


def test_engine_steps_and_their_batch_between_two_scrapes() -> None:
    def metrics(steps: int, tokens: int, generated: int) -> str:
        return "\n".join(
            [
                "# HELP vllm:iteration_tokens_total tokens per step",
                "# TYPE vllm:iteration_tokens_total histogram",
                f'vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf"}} {steps}',
                f'vllm:iteration_tokens_total_count{{engine="0"}} {steps}',
                f'vllm:iteration_tokens_total_sum{{engine="0"}} {tokens}',
                "# HELP vllm:generation_tokens generated",
                "# TYPE vllm:generation_tokens counter",
                f'vllm:generation_tokens_total{{engine="0"}} {generated}',
            ]
        ) + "\n"  # fmt: skip

    before, after = parse_scrape(metrics(10, 500, 100)), parse_scrape(metrics(30, 1500, 500))
    assert step_figures(before, after) == {
        "steps": 20.0,
        "tokens_per_step": 50.0,  # prompt tokens included
        "generated_per_step": 20.0,  # the requests decoded a step
    }
    assert step_figures(after, after) == {"steps": 0.0}  # no step: no per-step figures
