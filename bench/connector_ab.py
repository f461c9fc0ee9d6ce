"""One true/false ``kv_connector_extra_config`` key of our connector, on and off, measured
P/D side by side in one run: output tokens/s, TTFT and ITL through our router, and the
decode engine's own queue time (which holds its wait for the KV) and TTFT.

Each round starts one stack with the key on and one with it off (a prefill and a decode
engine, a core each, our router; :func:`bench.end_to_end.tiny_stack`), in an order that
alternates round by round, and runs ``vllm bench serve`` (random prompts, ``--ignore-eos``,
prefix caching off as in ``bench.pd_throughput``) against the router ``--runs`` times per
stack, every run with prompts of its own. A key is a switch only when both values start:
``direct_pins``, ``kv_digest``, ``reads_before_forward`` (CPU), ``lease_guard``.

    python -m bench.connector_ab --key direct_pins [--rounds 2] [--concurrency 32]
        [--shape tiny] [--runs 2]

Writes ``connector_ab_<key>.json`` under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.end_to_end import RESULTS, tiny_stack
from bench.pd_throughput import ENGINE_ARGS, SHAPES, model_spec
from bench.router_peer import bench_serve, prompts_for, run_seed, warm_up

VALUES = (True, False)


def measure_stack(
    key: str, value: bool, shape: str, concurrency: int, runs: int, round_index: int
) -> list[dict[str, Any]]:
    """``runs`` P/D runs on a fresh stack with ``key`` set to ``value``."""
    from bench.goodput import scrape, stage_means_ms

    rows = []
    extra = {key: value}
    with tiny_stack(kv_extra_config=extra, spec=model_spec(shape), engine_args=ENGINE_ARGS) as st:
        warm_up(st.urls["router"], st.model)
        for run in range(runs):
            seed = run_seed(round_index, concurrency, 2 * run + VALUES.index(value))
            before = scrape(st.urls["decode"])
            result = bench_serve(
                st.urls["router"],
                st.model,
                concurrency,
                prompts_for(concurrency, 6),
                st.work,
                seed,
                (256, 32),
            )
            stages = stage_means_ms(before, scrape(st.urls["decode"]))
            rows.append(
                {
                    "round": round_index,
                    "value": value,
                    "output_tokens_per_s": result["output_throughput"],
                    "ttft_p50_ms": result["median_ttft_ms"],
                    "itl_p50_ms": result["median_itl_ms"],
                    "decode_stage_means_ms": stages,
                }
            )
            print(
                f"  round {round_index + 1}, {key}={str(value).lower()}, run {run + 1}: "
                f"{result['output_throughput']:.0f} tok/s, TTFT p50 "
                f"{result['median_ttft_ms']:.0f} ms, ITL p50 {result['median_itl_ms']:.1f} ms, "
                f"decode engine {stages}",
                file=sys.stderr,
                flush=True,
            )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means per value, and on/off ratios of each round's means (one pair per round; a
    round without both values is left out of the ratios)."""
    metrics = ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms")
    by_value: dict[str, dict[str, float]] = {}
    for value in VALUES:
        mine = [r for r in rows if r["value"] is value]
        means = {m: statistics.mean(r[m] for r in mine) for m in metrics}
        for stage in ("queue", "ttft"):
            seen = [r["decode_stage_means_ms"].get(stage) for r in mine]
            seen = [s for s in seen if s is not None]
            if seen:
                means[f"decode_{stage}_ms"] = statistics.mean(seen)
        by_value[str(value).lower()] = means
    rounds = sorted({r["round"] for r in rows})
    ratios: dict[str, list[float]] = {m: [] for m in metrics}
    for index in rounds:
        for m in metrics:
            on = [r[m] for r in rows if r["round"] == index and r["value"] is True]
            off = [r[m] for r in rows if r["round"] == index and r["value"] is False]
            if on and off:  # a round cut short has no pair
                ratios[m].append(statistics.mean(on) / statistics.mean(off))
    return {"by_value": by_value, "on_vs_off_per_round": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--runs", type=int, default=2, help="runs per stack")
    parser.add_argument("--out", default=str(RESULTS), help="where results are written")
    args = parser.parse_args()
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        order = VALUES if round_index % 2 == 0 else VALUES[::-1]
        for value in order:
            print(f"round {round_index + 1}/{args.rounds}: {args.key}={value}", file=sys.stderr)
            rows += measure_stack(
                args.key, value, args.shape, args.concurrency, args.runs, round_index
            )
    result = {
        "key": args.key,
        "shape": args.shape,
        "concurrency": args.concurrency,
        "lengths": {"input": 256, "output": 32},
        "rounds": args.rounds,
        "runs_per_stack": args.runs,
        "wall_s": time.monotonic() - started,
        "runs": rows,
        **summarize(rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"connector_ab_{args.key}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("by_value", "on_vs_off_per_round")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
