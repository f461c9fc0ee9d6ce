"""P/D through our router against its decode engine serving alone, at the same concurrency,
for two model shapes, side by side in one run: output tokens/s, TTFT and end-to-end latency,
and where a P/D request's time goes by the engines' own histograms.

Per shape, one stack (a prefill and a decode engine, a core each, HybridNixlConnector, our
router; :func:`bench.end_to_end.start_stack`); ``vllm bench serve`` (random prompts,
``--ignore-eos``) runs against the router (P/D) and against the decode engine (alone), in an
order that alternates round by round, every run with prompts of its own. The shapes:

- ``tiny``: the default tiny hybrid, almost no compute per byte of KV: a 256-token prefill
  costs the decode engine about what its per-request handling does;
- ``real_compute``: the goodput benchmark's model, shaped so that its compute per byte of
  KV is a real GQA model's (``bench.goodput.bench_model_spec``).

Each run also records the engines' own stage means over it (``bench.goodput.STAGES``: the
prefill engine's TTFT, the decode engine's queue time, which holds its wait for the KV, its
first step and TTFT) and the load generator's ITL p50; and how long each engine's threads
ran and waited, runnable, for a CPU (``bench.cpu_waits``; a busy vLLM CPU engine polls for a
second after each message, so its CPU time alone says little), over a window that also
holds ``vllm bench serve``'s start and its untimed warm-up requests. Prefix caching
is off in both engines (``ENGINE_ARGS``); each run records the engines' hit shares (0
expected).
Headline: ``pd_vs_decode_alone_tokens_per_s`` per shape at the highest
concurrency (issue 34's goal: >= 1.0).

    python -m bench.pd_throughput [--concurrency 32] [--rounds 2] [--shapes tiny real_compute]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.end_to_end import RESULTS, tiny_stack
from bench.router_peer import (
    bench_serve,
    hit_shares,
    pooled,
    prefix_cache_counts,
    prompts_for,
    refresh_latest,
    run_seed,
    warm_up,
)

SHAPES = ("tiny", "real_compute")
WAYS = {"pd": "router", "decode_alone": "decode"}
ENGINES = ("prefill", "decode")
#: vLLM's random prompts start at a random token id and count up, so with the tiny models'
#: few hundred token ids they repeat across runs: with prefix caching on, the decode engine
#: alone found up to most of a run's prompts cached (P/D's moved KV included), the prefill
#: engine fewer. Off, every run computes what it is sent.
ENGINE_ARGS = ["--no-enable-prefix-caching"]


def model_spec(shape: str) -> Any:
    from bench.goodput import bench_model_spec
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec

    return TinyModelSpec() if shape == "tiny" else bench_model_spec()


def measure_shape(
    shape: str, concurrency: list[int], rounds: int, per_slot: int, lengths: tuple[int, int]
) -> list[dict[str, Any]]:
    """Every (round, concurrency, way) run on one stack of ``shape``."""
    import psutil

    from bench.cpu_waits import engine_processes, run_and_wait_s, thread_times
    from bench.goodput import scrape, stage_means_ms, step_figures
    from bench.goodput_stats import histogram_delta, histogram_quantile

    runs: list[dict[str, Any]] = []
    with tiny_stack(spec=model_spec(shape), engine_args=ENGINE_ARGS) as stack:
        warm_up(stack.urls["router"], stack.model)
        warm_up(stack.urls["decode"], stack.model)
        processes = {role: engine_processes(stack.urls[role]) for role in ENGINES}
        router = psutil.Process(stack.router_pid)
        for round_index in range(rounds):
            for c in concurrency:
                order = list(WAYS) if round_index % 2 == 0 else list(WAYS)[::-1]
                for way in order:
                    seed = run_seed(round_index, c, list(WAYS).index(way))
                    url = stack.urls[WAYS[way]]
                    cached = {role: prefix_cache_counts(stack.urls[role]) for role in ENGINES}
                    scraped = {role: scrape(stack.urls[role]) for role in ENGINES}
                    threads = {role: thread_times(processes[role]) for role in ENGINES}
                    router_cpu = sum(router.cpu_times()[:2])
                    result = bench_serve(
                        url, stack.model, c, prompts_for(c, per_slot), stack.work, seed, lengths
                    )
                    later = {role: scrape(stack.urls[role]) for role in ENGINES}
                    cpu = {
                        role: run_and_wait_s(threads[role], thread_times(processes[role]))
                        for role in ENGINES
                    }
                    cpu["router"] = {"run_s": sum(router.cpu_times()[:2]) - router_cpu}
                    stages = {role: stage_means_ms(scraped[role], later[role]) for role in ENGINES}
                    decode_itl = histogram_delta(scraped["decode"].itl, later["decode"].itl)
                    after = {role: prefix_cache_counts(stack.urls[role]) for role in ENGINES}
                    runs.append(
                        {
                            "shape": shape,
                            "round": round_index,
                            "concurrency": c,
                            "way": way,
                            "output_tokens": result["total_output_tokens"],
                            "duration_s": result["duration"],
                            "output_tokens_per_s": result["output_throughput"],
                            "itl_p50_ms": result["median_itl_ms"],
                            # the decode engine's own, between the tokens it produced
                            "engine_itl_p50_ms": histogram_quantile(decode_itl, 0.5) * 1e3,
                            "engine_itl_p99_ms": histogram_quantile(decode_itl, 0.99) * 1e3,
                            # its steps and batch (a smaller batch pays a step's fixed cost
                            # over fewer tokens)
                            "decode_engine_steps": step_figures(scraped["decode"], later["decode"]),
                            "ttfts_ms": [t * 1e3 for t in result["ttfts"] if t],
                            "e2els_ms": [t * 1e3 for t in result["latencies"] if t],
                            "engine_stage_means_ms": stages,
                            # seconds each engine's threads ran and waited for a CPU over
                            # the run (bench.cpu_waits), and the router's CPU seconds
                            "cpu_s": cpu,
                            "prefix_cache_hit_share": hit_shares(cached, after),
                        }
                    )
                    print(
                        f"  {shape}, round {round_index + 1}, c={c}, {way}: "
                        f"{result['output_throughput']:.0f} tok/s, TTFT p50 "
                        f"{result['median_ttft_ms']:.0f} ms, ITL p50 "
                        f"{result['median_itl_ms']:.1f} ms (decode engine's "
                        f"{runs[-1]['engine_itl_p50_ms']:.1f}), decode engine steps "
                        f"{runs[-1]['decode_engine_steps']}, engines {stages}, CPU s {cpu}",
                        file=sys.stderr,
                        flush=True,
                    )
    return runs


def median_of_finite(values: Iterable[float]) -> float:
    """The median of the values that are numbers (runs without the figure give NaN); NaN
    when none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def mean_of_finite(values: Iterable[float]) -> float:
    """The mean of the values that are numbers; NaN when none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def cpu_figure(run: dict[str, Any], part: str, figure: str) -> float:
    """One ``cpu_s`` figure of a run; NaN for runs recorded before it existed."""
    return run.get("cpu_s", {}).get(part, {}).get(figure, math.nan)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures per (shape, concurrency, way), per-round P/D / alone ratios, headline."""
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        table.setdefault(run["shape"], {}).setdefault(str(run["concurrency"]), {})
    for shape, by_c in table.items():
        for c in by_c:
            for way in WAYS:
                chosen = [
                    r
                    for r in runs
                    if r["shape"] == shape and str(r["concurrency"]) == c and r["way"] == way
                ]
                if not chosen:
                    continue
                by_c[c][way] = {
                    **pooled(chosen),  # tokens over run time, percentiles over requests
                    "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in chosen),
                    "engine_itl_p50_ms": median_of_finite(
                        r.get("engine_itl_p50_ms", math.nan) for r in chosen
                    ),
                    "decode_generated_per_step": mean_of_finite(
                        r.get("decode_engine_steps", {}).get("generated_per_step", math.nan)
                        for r in chosen
                    ),
                    # per 1,000 output tokens: seconds the decode engine's threads waited
                    # for a CPU (another process or its own other threads had the core; over
                    # the window around bench_serve, warm-up included) and the router's CPU
                    "decode_wait_for_cpu_s_per_1k_tokens": mean_of_finite(
                        1e3 * cpu_figure(r, "decode", "wait_for_cpu_s") / r["output_tokens"]
                        for r in chosen
                    ),
                    "router_cpu_s_per_1k_tokens": mean_of_finite(
                        1e3 * cpu_figure(r, "router", "run_s") / r["output_tokens"] for r in chosen
                    ),
                    "engine_stage_means_ms": {
                        role: {
                            stage: statistics.fmean(
                                r["engine_stage_means_ms"][role][stage]
                                for r in chosen
                                if stage in r["engine_stage_means_ms"][role]
                            )
                            for stage in chosen[0]["engine_stage_means_ms"][role]
                        }
                        for role in chosen[0]["engine_stage_means_ms"]
                    },
                }
            per_round = ratios.setdefault(shape, {}).setdefault(c, [])
            for round_index in sorted({r["round"] for r in runs}):
                pair = {
                    r["way"]: r
                    for r in runs
                    if r["shape"] == shape
                    and str(r["concurrency"]) == c
                    and r["round"] == round_index
                }
                if len(pair) == len(WAYS):
                    per_round.append(
                        pair["pd"]["output_tokens_per_s"]
                        / pair["decode_alone"]["output_tokens_per_s"]
                    )
    headline: dict[str, float] = {}
    for shape, by_c in table.items():
        top = max(by_c, key=int)
        if set(WAYS) <= set(by_c[top]):
            headline[f"pd_vs_decode_alone_tokens_per_s_{shape}"] = (
                by_c[top]["pd"]["output_tokens_per_s"]
                / by_c[top]["decode_alone"]["output_tokens_per_s"]
            )
    return {"by_shape": table, "per_round_pd_vs_alone": ratios, "headline": headline}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| shape | concurrent | way | output tok/s | TTFT p50 ms | TTFT p99 ms | E2E p50 ms "
        "| ITL p50 ms | decode engine ITL p50 ms | decode engine tokens generated a step "
        "| prefill engine TTFT ms | decode engine queue ms | decode engine TTFT ms "
        "| decode engine's wait for a CPU, s per 1k tokens | router CPU s per 1k tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, by_c in result["by_shape"].items():
        for c, ways in by_c.items():
            for way, row in ways.items():
                stages = row["engine_stage_means_ms"]
                prefill_ttft = stages["prefill"].get("ttft", math.nan) if way == "pd" else math.nan
                lines.append(
                    f"| {shape} | {c} | {way} | {row['output_tokens_per_s']:.0f} | "
                    f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | "
                    f"{row['e2el_p50_ms']:.0f} | {row['itl_p50_ms']:.1f} | "
                    f"{row['engine_itl_p50_ms']:.1f} | {row['decode_generated_per_step']:.1f} | "
                    f"{prefill_ttft:.0f} | "
                    f"{stages['decode'].get('queue', math.nan):.0f} | "
                    f"{stages['decode'].get('ttft', math.nan):.0f} | "
                    f"{row.get('decode_wait_for_cpu_s_per_1k_tokens', math.nan):.2f} | "
                    f"{row.get('router_cpu_s_per_1k_tokens', math.nan):.2f} |"
                )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts-per-slot", type=int, default=6)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS), help="where results are written")
    args = parser.parse_args()
    started = time.monotonic()
    lengths = (args.input_len, args.output_len)
    runs = [
        run
        for shape in args.shapes
        for run in measure_shape(
            shape, args.concurrency, args.rounds, args.prompts_per_slot, lengths
        )
    ]
    from datetime import datetime, timezone

    from bench.__main__ import commit

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "lengths": {"input": lengths[0], "output": lengths[1]},
        "rounds": args.rounds,
        "prompts_per_run": {
            str(c): prompts_for(c, args.prompts_per_slot) for c in args.concurrency
        },
        "wall_s": time.monotonic() - started,
        "runs": runs,
        **summarize(runs),
    }
    print(table(result))
    print(json.dumps(result["headline"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd_throughput.json").write_text(json.dumps(result, indent=2))
    refresh_latest(result["headline"], out / "latest.json", section="pd_throughput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
