"""Conditional disaggregation: time to first token of short prompts through the router with
``--short-prompt-tokens`` (colocated on the decode engine) against the decode engine alone
and against the router sending every prompt P/D, side by side in one run, alternating; long
prompts through the same router still go P/D (the decode engine's NIXL bytes say so).

    python -m bench.short_prompts [--requests 24] [--threshold 64]

One prefill and one decode ``vllm serve`` (tiny hybrid model, a core each) and two router
processes in front of them: one without a threshold, one with; and, as the floor any Python
hop sets, ``bench.passthrough_proxy`` (an aiohttp relay with no parsing or policy) in front of
the decode engine. One request at a time, each
prompt new (no prefix-cache hits), the ways rotated request by request. Writes
``short_prompts.json`` under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.end_to_end import RESULTS, start_stack, timed_request, wait_for_health
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.common.processes import die_with_parent
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters

WAYS = ("decode_alone", "router_pd", "router_conditional", "passthrough_proxy")
WORDS = "hybrid state blocks move between engines over nixl".split()


def prompt(index: int, words: int) -> str:
    """A prompt no earlier request shares a block with: its index leads."""
    body = " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words))
    return f"{index} {body}"


def start_router(urls: dict[str, str], threshold: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    script = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))
    with open(log, "wb") as out:
        router = subprocess.Popen(
            [script, "router", "--port", str(port), "--prefill", urls["prefill"],
             "--decode", urls["decode"], "--short-prompt-tokens", str(threshold)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ}, start_new_session=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, [router])
    return router, url


async def first_token_s(urls: dict[str, str], body: dict[str, Any]) -> float:
    """Seconds to the first streamed token from ``urls["router"]`` (an engine or a router)."""
    async with httpx.AsyncClient(timeout=600) as client:
        _, ttft, _ = await timed_request(client, "router", urls, body)
    return ttft


@contextmanager
def three_ways(threshold: int) -> Iterator[tuple[str, dict[str, str], dict[str, dict[str, str]]]]:
    """A tiny hybrid model, its P/D stack (a prefill and a decode engine, a router without a
    threshold) and a second router with ``--short-prompt-tokens threshold``: the model, the
    stack's URLs and each of ``WAYS`` as the URLs its requests go to (``"router"``)."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model", TinyModelSpec()))
        urls, stop = start_stack(model, Path(tmp))
        try:
            router, conditional_url = start_router(urls, threshold, Path(tmp) / "router.log")
        except BaseException:
            stop()
            raise
        ways = {
            "decode_alone": {**urls, "router": urls["decode"]},
            "router_pd": urls,
            "router_conditional": {**urls, "router": conditional_url},
        }
        try:
            yield model, urls, ways
        finally:
            router.terminate()
            router.wait(timeout=20)
            stop()


@contextmanager
def passthrough_proxy(upstream: str) -> Iterator[str]:
    """``bench.passthrough_proxy`` in front of ``upstream``, as its own process; its URL."""
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "bench.passthrough_proxy", str(port), upstream],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, [proxy])
        yield url
    finally:
        proxy.terminate()
        proxy.wait(timeout=20)


def run(requests: int, threshold: int, short_words: int, long_words: int) -> dict[str, Any]:
    with (
        three_ways(threshold) as (model, urls, ways),
        passthrough_proxy(urls["decode"]) as proxy_url,
    ):
        ways["passthrough_proxy"] = {**urls, "router": proxy_url}
        ttft: dict[str, list[float]] = {way: [] for way in WAYS}
        long_nixl: list[float] = []
        for index in range(requests + 1):  # the first round warms every way up: untimed
            shift = index % len(WAYS)
            order = WAYS[shift:] + WAYS[:shift]
            for offset, way in enumerate(order):
                body = {"model": model, "max_tokens": 4, "temperature": 0.0}
                body.update(ignore_eos=True, stream=True)
                body["prompt"] = prompt(index * 10 + offset, short_words)
                seconds = asyncio.run(first_token_s(ways[way], body))
                if index:
                    ttft[way].append(seconds)
            long_body = {"model": model, "max_tokens": 4, "temperature": 0.0, "stream": True}
            long_body["prompt"] = prompt(index * 10 + 9, long_words)
            before = read_kv_transfer_counters(urls["decode"])
            asyncio.run(first_token_s(ways["router_conditional"], long_body))
            long_nixl.append((read_kv_transfer_counters(urls["decode"]) - before).nixl_bytes)
            print(f"request {index}/{requests}", file=sys.stderr, flush=True)
        choices = httpx.get(f"{ways['router_conditional']['router']}/metrics", timeout=10).text
    medians = {way: statistics.median(values) for way, values in ttft.items()}
    return {
        "requests": requests,
        "threshold_tokens": threshold,
        "short_prompt_words": short_words,
        "long_prompt_words": long_words,
        "ttft_median_s": medians,
        "ttft_p90_s": {way: statistics.quantiles(v, n=10)[-1] for way, v in ttft.items()},
        "conditional_vs_decode_alone_ttft": medians["router_conditional"] / medians["decode_alone"],
        "pd_vs_decode_alone_ttft": medians["router_pd"] / medians["decode_alone"],
        "passthrough_vs_decode_alone_ttft": medians["passthrough_proxy"] / medians["decode_alone"],
        "long_prompts_moved_kv": sum(1 for b in long_nixl if b > 0),
        "long_prompts": len(long_nixl),
        "short_prompt_choices_line": [
            line for line in choices.splitlines() if 'reason="short_prompt"' in line
        ],
        "ttft_s": ttft,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--threshold", type=int, default=64)
    parser.add_argument("--short-words", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "short_prompts.json")
    args = parser.parse_args()
    started = time.monotonic()
    result = run(args.requests, args.threshold, args.short_words, args.long_words)
    result["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for way in WAYS:
        print(f"{way:>20}: TTFT median {result['ttft_median_s'][way] * 1000:.1f} ms")
    print(
        f"conditional / decode alone {result['conditional_vs_decode_alone_ttft']:.2f}x, "
        f"P/D / decode alone {result['pd_vs_decode_alone_ttft']:.2f}x, a bare Python hop / "
        f"decode alone {result['passthrough_vs_decode_alone_ttft']:.2f}x; long prompts that "
        f"moved KV: {result['long_prompts_moved_kv']}/{result['long_prompts']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
