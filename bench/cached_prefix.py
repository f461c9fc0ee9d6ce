"""Conditional disaggregation by cache: time to first token of a conversation's next turn
(its earlier turn's prompt plus a few words) through the router with
``--short-prompt-tokens`` (the decode engine holds the earlier turn: ``cached_prefix``, run
there colocated) against the router sending every prompt P/D and against the decode engine
alone, side by side in one run, alternating.

    python -m bench.cached_prefix [--conversations 12] [--threshold 64]

One prefill and one decode ``vllm serve`` (tiny hybrid model, a core each) and a router
process with the threshold in front of them, beside the stack's own router without one. Each
way gets conversations of its own (no way sees another's cache): the first turn (a long
prompt, untimed) goes the same way, then the next turn is timed. Writes
``cached_prefix.json`` under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.end_to_end import RESULTS
from bench.short_prompts import first_token_s, prompt, three_ways
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters

#: the ways a conversation goes (``bench.short_prompts.three_ways``; no bare relay here)
WAYS = ("decode_alone", "router_pd", "router_conditional")


def run(conversations: int, threshold: int, first_words: int) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {way: [] for way in WAYS}
    next_turn_nixl: dict[str, list[float]] = {way: [] for way in WAYS}
    with three_ways(threshold) as (model, urls, ways):
        for index in range(conversations + 1):  # the first round warms up: untimed
            shift = index % len(WAYS)
            order = WAYS[shift:] + WAYS[:shift]
            for offset, way in enumerate(order):
                body = {"model": model, "max_tokens": 4, "temperature": 0.0}
                body.update(ignore_eos=True, stream=True)
                body["prompt"] = prompt(index * 10 + offset, first_words)
                asyncio.run(first_token_s(ways[way], body))  # the earlier turn
                body["prompt"] += " and then the tide turned"
                before = read_kv_transfer_counters(urls["decode"])
                seconds = asyncio.run(first_token_s(ways[way], body))
                moved = (read_kv_transfer_counters(urls["decode"]) - before).nixl_bytes
                if index:
                    ttft[way].append(seconds)
                    next_turn_nixl[way].append(moved)
            print(f"conversation round {index}/{conversations}", file=sys.stderr, flush=True)
        choices = httpx.get(f"{ways['router_conditional']['router']}/metrics", timeout=10).text
    medians = {way: statistics.median(values) for way, values in ttft.items()}
    return {
        "conversations": conversations,
        "threshold_tokens": threshold,
        "first_turn_words": first_words,
        "ttft_median_s": medians,
        "conditional_vs_decode_alone_ttft": medians["router_conditional"] / medians["decode_alone"],
        "conditional_vs_pd_ttft": medians["router_conditional"] / medians["router_pd"],
        "next_turns_that_moved_kv": {
            way: sum(1 for b in values if b > 0) for way, values in next_turn_nixl.items()
        },
        "cached_prefix_choices_line": [
            line for line in choices.splitlines() if 'reason="cached_prefix"' in line
        ],
        "ttft_s": ttft,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--threshold", type=int, default=64)
    parser.add_argument("--first-words", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "cached_prefix.json")
    args = parser.parse_args()
    started = time.monotonic()
    result = run(args.conversations, args.threshold, args.first_words)
    result["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for way in WAYS:
        print(f"{way:>20}: next-turn TTFT median {result['ttft_median_s'][way] * 1000:.1f} ms")
    print(
        f"conditional / decode alone {result['conditional_vs_decode_alone_ttft']:.2f}x, "
        f"conditional / P/D {result['conditional_vs_pd_ttft']:.2f}x; next turns that moved KV: "
        f"{result['next_turns_that_moved_kv']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
