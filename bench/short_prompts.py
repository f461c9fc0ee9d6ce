"""Conditional disaggregation: time to first token of short prompts through the router with
``--short-prompt-tokens`` (colocated on the decode engine) against the decode engine alone
and against the router sending every prompt P/D, side by side in one run, alternating; long
prompts through the same router still go P/D (the decode engine's NIXL bytes say so).

    python -m bench.short_prompts [--requests 24] [--threshold 64] [--short-words 8]

The committed runs: ``--requests 80 --threshold 256 --short-words 8 40 80`` (a new client
connection a request, ``short_prompts.json``) and the same with ``--kept-alive --out
bench/results/short_prompts_kept_alive.json`` (each way keeps one connection, as ``vllm
bench serve`` and the ``openai`` client do).

One prefill and one decode ``vllm serve`` (tiny hybrid model, a core each) and two router
processes in front of them: one without a threshold, one with; and, as the floor any Python
hop sets, ``bench.passthrough_proxy`` (an aiohttp relay with no parsing or policy) in front of
the decode engine. One request at a time, each prompt new (no prefix-cache hits), the ways
rotated request by request, for each short prompt length in turn (each must stay below the
threshold in the engine's own tokens). Writes
``short_prompts.json`` under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from bench.end_to_end import RESULTS, count_tokens, start_stack, timed_request, wait_for_health
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


def ttft_rounds(
    ways: dict[str, dict[str, str]],
    model: str,
    requests: int,
    words: int,
    seed: int,
    kept_alive: bool = False,
) -> dict[str, list[float]]:
    """Seconds to the first token of ``requests`` new ``words``-word prompts per way, the
    ways rotated request by request (a first, untimed round warms every way up). Each request
    opens a connection of its own, or (``kept_alive``) each way keeps one client and its
    connection for the run, as ``vllm bench serve`` and the ``openai`` client do."""
    return asyncio.run(_ttft_rounds(ways, model, requests, words, seed, kept_alive))


async def _ttft_rounds(
    ways: dict[str, dict[str, str]],
    model: str,
    requests: int,
    words: int,
    seed: int,
    kept_alive: bool,
) -> dict[str, list[float]]:
    ttft: dict[str, list[float]] = {way: [] for way in WAYS}
    clients = {way: httpx.AsyncClient(timeout=600) for way in WAYS} if kept_alive else {}
    try:
        for index in range(requests + 1):
            shift = index % len(WAYS)
            order = WAYS[shift:] + WAYS[:shift]
            for offset, way in enumerate(order):
                body = {"model": model, "max_tokens": 4, "temperature": 0.0}
                body.update(ignore_eos=True, stream=True)
                body["prompt"] = prompt(seed + index * 10 + offset, words)
                if kept_alive:
                    _, seconds, _ = await timed_request(clients[way], "router", ways[way], body)
                else:
                    seconds = await first_token_s(ways[way], body)
                if index:
                    ttft[way].append(seconds)
    finally:
        for client in clients.values():
            await client.aclose()
    return ttft


def short_prompt_choices(metrics_text: str) -> float:
    """How many requests the router ran on its short-prompt path, from its /metrics."""
    from vllm_hybrid_nixl.deploy.metrics_text import sample_sum

    return sample_sum(metrics_text, "router_policy_choices_total", reason="short_prompt")


def median_ratio_interval(
    numerator: list[float], denominator: list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95 % bootstrap interval of median(numerator) / median(denominator). The samples are
    paired (sample i of each way ran in the same round of the rotation), so rounds are drawn
    again with replacement, ``resamples`` times, with a fixed seed: a run's interval is
    reproducible from its samples."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("the two ways need the same number of rounds, at least one")
    rounds = range(len(numerator))
    draw = random.Random(seed).choices
    found = []
    for _ in range(resamples):
        picked = draw(rounds, k=len(rounds))
        found.append(
            statistics.median(numerator[i] for i in picked)
            / statistics.median(denominator[i] for i in picked)
        )
    found.sort()
    return found[round(0.025 * resamples)], found[round(0.975 * resamples) - 1]


def ratios(ttft: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, p90s, each way's median against the decode engine alone's (with a 95 %
    bootstrap interval for the router and the bare relay), and the router's added
    milliseconds (median against median)."""
    medians = {way: statistics.median(values) for way, values in ttft.items()}
    alone = medians["decode_alone"]
    alone_samples = ttft["decode_alone"]
    return {
        "conditional_vs_decode_alone_ttft_95ci": median_ratio_interval(
            ttft["router_conditional"], alone_samples
        ),
        "passthrough_vs_decode_alone_ttft_95ci": median_ratio_interval(
            ttft["passthrough_proxy"], alone_samples
        ),
        "ttft_median_s": medians,
        "ttft_p90_s": {way: statistics.quantiles(v, n=10)[-1] for way, v in ttft.items()},
        "conditional_vs_decode_alone_ttft": medians["router_conditional"] / alone,
        "pd_vs_decode_alone_ttft": medians["router_pd"] / alone,
        "passthrough_vs_decode_alone_ttft": medians["passthrough_proxy"] / alone,
        "conditional_added_ms": (medians["router_conditional"] - alone) * 1e3,
        "passthrough_added_ms": (medians["passthrough_proxy"] - alone) * 1e3,
    }


def run(
    requests: int,
    threshold: int,
    short_words: list[int],
    long_words: int,
    kept_alive: bool = False,
) -> dict[str, Any]:
    """Every short prompt length in ``short_words``, then long prompts through the
    conditional router (they must still move KV)."""
    with (
        three_ways(threshold) as (model, urls, ways),
        passthrough_proxy(urls["decode"]) as proxy_url,
    ):
        ways["passthrough_proxy"] = {**urls, "router": proxy_url}
        by_words: dict[str, Any] = {}
        for step, words in enumerate(short_words):
            seed = step * 1_000_000
            tokens = count_tokens(urls["decode"], model, prompt(0, words))
            longest = count_tokens(urls["decode"], model, prompt(seed + requests * 10 + 9, words))
            if longest >= threshold:
                raise SystemExit(
                    f"{words}-word prompts run to {longest} tokens, not below --threshold "
                    f"{threshold}: raise --threshold or pass fewer --short-words"
                )
            ttft = ttft_rounds(ways, model, requests, words, seed=seed, kept_alive=kept_alive)
            by_words[str(words)] = {"prompt_tokens": tokens, **ratios(ttft), "ttft_s": ttft}
            figures = by_words[str(words)]
            low, high = figures["conditional_vs_decode_alone_ttft_95ci"]
            print(
                f"{words} words ({tokens} tokens): conditional / decode alone "
                f"{figures['conditional_vs_decode_alone_ttft']:.2f}x "
                f"(95% interval {low:.2f}-{high:.2f}x, +{figures['conditional_added_ms']:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )
        long_nixl: list[float] = []
        for index in range(requests):
            long_body = {"model": model, "max_tokens": 4, "temperature": 0.0, "stream": True}
            long_body["prompt"] = prompt(90_000_000 + index, long_words)
            before = read_kv_transfer_counters(urls["decode"])
            asyncio.run(first_token_s(ways["router_conditional"], long_body))
            long_nixl.append((read_kv_transfer_counters(urls["decode"]) - before).nixl_bytes)
        long_tokens = count_tokens(urls["decode"], model, prompt(0, long_words))
        choices = httpx.get(f"{ways['router_conditional']['router']}/metrics", timeout=10).text
    taken = short_prompt_choices(choices)
    expected = (requests + 1) * len(short_words)  # the warm-up round included
    if taken != expected:  # the router estimates text at 4 bytes a token, not the engine's
        raise RuntimeError(
            f"the conditional router ran {taken:g} requests on its short-prompt path, "
            f"expected {expected} (every short prompt, no long one): the figures would not "
            "measure that path; set --threshold between the short and the long prompts' "
            "lengths as the router estimates them (4 UTF-8 bytes a token)"
        )
    shortest = by_words[str(short_words[0])]
    return {
        "requests": requests,
        "client_connections": "kept alive, one a way" if kept_alive else "new, one a request",
        "threshold_tokens": threshold,
        "short_prompt_words": short_words,
        "long_prompt_words": long_words,
        "long_prompt_tokens": long_tokens,
        # the shortest prompts' figures at the top level, as before
        **{key: value for key, value in shortest.items() if key != "ttft_s"},
        "by_prompt_words": by_words,
        "long_prompts_moved_kv": sum(1 for b in long_nixl if b > 0),
        "long_prompts": len(long_nixl),
        "short_prompt_choices_line": [
            line for line in choices.splitlines() if 'reason="short_prompt"' in line
        ],
    }


def latest_keys(result: dict[str, Any]) -> dict[str, Any]:
    """This run's figures as ``latest.json`` keys, keyed by prompt tokens."""
    by_tokens = {str(f["prompt_tokens"]): f for f in result["by_prompt_words"].values()}
    return {
        "short_prompt_conditional_vs_decode_alone_ttft": {
            tokens: round(f["conditional_vs_decode_alone_ttft"], 3)
            for tokens, f in by_tokens.items()
        },
        "short_prompt_conditional_vs_decode_alone_ttft_95ci": {
            tokens: [round(bound, 3) for bound in f["conditional_vs_decode_alone_ttft_95ci"]]
            for tokens, f in by_tokens.items()
        },
        "short_prompt_router_added_ms": {
            tokens: round(f["conditional_added_ms"], 2) for tokens, f in by_tokens.items()
        },
        "short_prompt_passthrough_vs_decode_alone_ttft": {
            tokens: round(f["passthrough_vs_decode_alone_ttft"], 3)
            for tokens, f in by_tokens.items()
        },
        "short_prompts_date": result["date"],
        "short_prompts_commit": result["commit"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--threshold", type=int, default=64)
    parser.add_argument(
        "--short-words", type=int, nargs="+", default=[8], help="short prompt lengths, in words"
    )
    parser.add_argument("--long-words", type=int, default=300)
    parser.add_argument(
        "--kept-alive",
        action="store_true",
        help="each way keeps one client connection for the run (as vllm bench serve and the "
        "openai client do) instead of a new connection a request",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "short_prompts.json")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2 (a p90 needs two requests a way)")
    started = time.monotonic()
    result = run(args.requests, args.threshold, args.short_words, args.long_words, args.kept_alive)
    from bench.__main__ import commit

    result["seconds"] = round(time.monotonic() - started, 1)
    result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result["commit"] = commit()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.out.resolve() == (RESULTS / "short_prompts.json").resolve():  # the committed file
        latest_path = RESULTS / "latest.json"
        latest = json.loads(latest_path.read_text()) if latest_path.exists() else {}
        latest_path.write_text(json.dumps({**latest, **latest_keys(result)}, indent=2))
        print(f"headline written into {latest_path}")
    for words, figures in result["by_prompt_words"].items():
        medians = ", ".join(f"{way} {figures['ttft_median_s'][way] * 1000:.1f}" for way in WAYS)
        print(f"{words} words ({figures['prompt_tokens']} tokens), TTFT median ms: {medians}")
        low, high = figures["conditional_vs_decode_alone_ttft_95ci"]
        print(
            f"  conditional / decode alone {figures['conditional_vs_decode_alone_ttft']:.2f}x "
            f"(95% interval {low:.2f}-{high:.2f}x, +{figures['conditional_added_ms']:.1f} ms), "
            "P/D / decode alone "
            f"{figures['pd_vs_decode_alone_ttft']:.2f}x, a bare Python hop / decode alone "
            f"{figures['passthrough_vs_decode_alone_ttft']:.2f}x"
        )
    print(f"long prompts that moved KV: {result['long_prompts_moved_kv']}/{result['long_prompts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
