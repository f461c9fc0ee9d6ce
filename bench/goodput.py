"""When does P/D win here? Goodput of ways of serving the same model on the same two
cores, under open-loop Poisson arrivals at rising rates, side by side in one run:

- ``pd``: a prefill engine (core 0) and a decode engine (core 1), our router in front;
- ``colocated_x2``: two engines without a KV connector (a core each), the same router in
  front, every prompt under its ``--short-prompt-tokens`` threshold, so each request runs
  whole on the less busy engine;
- ``one_engine``: one engine on both cores, no router;
- ``colocated_x2_small_chunks`` (only with ``--ways``): ``colocated_x2`` tuned for short
  stalls, 512 prompt tokens per step instead of vLLM's CPU default of 2048.

Two arrival streams: prefill-heavy (prompts of 1-4k tokens, 64-256 output tokens) and
decode-heavy (128-512 prompt tokens, 256-512 output tokens). At each rate the ways get
the same requests (prompts, lengths, arrival times), in an order that rotates rate by rate; no
prompt repeats across rates, so no prefix-cache hits. Reported per way and rate, from the
client: TTFT, time per output token (TPOT) and each request's longest gap between two
streamed tokens (p50/p99); from the engines: inter-token latency
(``vllm:inter_token_latency_seconds``, finer buckets) p50/p99 and the mean time of each
stage (queue, scheduled to first token, NIXL read); the share of requests meeting both SLOs
(TTFT, and no gap between tokens longer than a stated bound: the stall a reader sees while
another prompt prefills on the same engine), goodput (the highest rate with >= 90% within
SLO) and the crossover rate between ``pd`` and each colocated way.

The model: a tiny random-weight sliding-window/full-attention hybrid shaped so that its
compute per byte of KV is that of a real GQA model (few KV heads, a wide MLP; see
``goodput_stats.LLAMA3_8B``), not a toy's.

    python -m bench.goodput [--requests 20] [--workloads prefill_heavy decode_heavy]
    python -m bench.goodput --workloads prefill_heavy --stem goodput_chunks \
        --ways pd colocated_x2 colocated_x2_small_chunks

Writes ``STEM.json`` and ``STEM.png`` under ``--out`` (``bench/results/``); the default stem
(``goodput``) also puts the headline into ``latest.json`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.end_to_end import PACED, RESULTS, percentile, wait_for_health
from bench.goodput_stats import (
    ATTAINMENT_GOAL,
    LLAMA3_8B,
    Sample,
    Shape,
    attainment,
    crossover_rate,
    goodput_rate,
    histogram_delta,
    histogram_quantile,
    mean_delta,
    summed_buckets,
)
from bench.router_peer import refresh_latest

WAYS = ("pd", "colocated_x2", "one_engine")  # the default run; see PLANS for one more
ITL_METRIC = "vllm:inter_token_latency_seconds"
#: Tokens per engine step (one observation a step) and tokens generated.
STEP_METRIC = "vllm:iteration_tokens_total"
GENERATED_METRIC = "vllm:generation_tokens_total"
#: Finer than vLLM's default ITL buckets (10, 25, 50, 75, 100 ms ...): p50/p99 read from them.
ITL_BUCKETS = [i / 1000 for i in (*range(2, 40, 2), *range(40, 100, 5), *range(100, 300, 20))]
ITL_BUCKETS += [0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0]
MAX_MODEL_LEN = 4608
#: Every prompt runs colocated under this threshold (``colocated_x2``'s router).
EVERYTHING = 10**9


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: tuple[int, int]  # uniform, inclusive
    output_tokens: tuple[int, int]
    rates: tuple[float, ...]  # requests per second, rising
    ttft_slo_s: float
    gap_slo_s: float  # the longest wait between two streamed tokens a request may see


WORKLOADS = {
    "prefill_heavy": Workload(
        "prefill_heavy", (1024, 4096), (64, 256), (0.25, 0.5, 0.75, 1.0), 4.0, 0.3
    ),
    "decode_heavy": Workload(
        "decode_heavy", (128, 512), (256, 512), (0.5, 1.0, 2.0, 3.0), 2.0, 0.3
    ),
}


def bench_model_spec():
    """The model: llama-hybrid (sliding window 128 on every other layer), hidden 768, 12
    query heads and 1 KV head of 64, an MLP 6x as wide."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec

    return TinyModelSpec(
        arch="llama-hybrid", layers=4, hidden=768, heads=12, kv_heads=1, mlp_ratio=6,
        sliding_window=128, max_positions=MAX_MODEL_LEN,
    )  # fmt: skip


def model_shape(spec) -> Shape:
    return Shape(
        hidden=spec.hidden,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        intermediate=spec.hidden * spec.mlp_ratio,
    )


@dataclass(frozen=True)
class Request:
    at_s: float  # arrival, from the run's start
    prompt: list[int]  # token ids: exact lengths, no tokenizer round trip
    output_tokens: int


def arrivals(workload: Workload, rate: float, count: int, seed: int, vocab: int) -> list[Request]:
    """``count`` requests arriving as a Poisson process of ``rate`` per second, with
    uniform prompt and output lengths; random token ids, so no two prompts share a block."""
    rng = random.Random(seed)
    at, requests = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        length = rng.randint(*workload.prompt_tokens)
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        requests.append(Request(at, prompt, rng.randint(*workload.output_tokens)))
    return requests


@dataclass
class Way:
    name: str
    url: str  # where its clients post
    engines: list[str] = field(default_factory=list)  # whose histograms count
    roles: list[str] = field(default_factory=list)  # a name for each of engines


def _engine(model: str, role: str, cores: int | list[int], log: Path, extra: list[str]):
    from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
    from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec

    args = ["--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "64"]
    args += ["--custom-histogram-buckets", json.dumps({"inter_token_latency": ITL_BUCKETS})]
    args += extra
    spec = EngineSpec(
        model=model,
        port=free_port(),
        role=role,
        side_channel_port=free_side_channel_port(),
        cpu_core=cores,
        extra_args=args,
        kv_extra_config=dict(PACED) if role != "none" else {},
    )
    return EngineProcess(spec, log).start()


def _router(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    from vllm_hybrid_nixl.common.netutil import free_port
    from vllm_hybrid_nixl.common.processes import die_with_parent
    from vllm_hybrid_nixl.deploy.keepalive import router_keep_alive_s

    port = free_port()
    script = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))
    command = [script, "router", "--port", str(port), *args]
    command += ["--keepalive-expiry-s", str(router_keep_alive_s({}))]
    with open(log, "wb") as out:
        router = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ},
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, [router], timeout_s=120)
    return router, url


#: Each way's engines (role, cores, extra ``vllm serve`` flags) and how its router, if it has
#: one, is told of them. ``colocated_x2_small_chunks`` is the colocated pair tuned for short
#: stalls: 512 tokens per step (vLLM's CPU default: 2048), so a long prompt prefills in
#: more, shorter steps beside the other requests' decoding.
SMALL_CHUNKS = ["--max-num-batched-tokens", "512"]
PLANS: dict[str, dict[str, tuple[str, int | list[int], list[str]]]] = {
    "pd": {"prefill": ("prefill", 0, []), "decode": ("decode", 1, [])},
    "colocated_x2": {"engine_a": ("none", 0, []), "engine_b": ("none", 1, [])},
    "colocated_x2_small_chunks": {
        "engine_a": ("none", 0, SMALL_CHUNKS),
        "engine_b": ("none", 1, SMALL_CHUNKS),
    },
    "one_engine": {"engine": ("none", [0, 1], [])},
}


def _router_args(way: str, urls: dict[str, str]) -> list[str] | None:
    if way == "pd":
        return ["--prefill", urls["prefill"], "--decode", urls["decode"]]
    if way.startswith("colocated_x2"):
        # Two colocated engines behind the same router: the first is also named as the
        # (never used) prefill engine the router requires; every prompt is "short".
        return ["--prefill", urls["engine_a"], "--decode", urls["engine_a"],
                "--decode", urls["engine_b"], "--short-prompt-tokens", str(EVERYTHING)]  # fmt: skip
    return None  # one engine: clients talk to it


@contextmanager
def serving_ways(model: str, log_dir: Path, names: list[str]) -> Iterator[dict[str, Way]]:
    """Every engine and router of the named ways, all up at once (an idle engine costs its
    core ~2%: NIXL's progress thread is paced): the ways by name."""
    engines: dict[tuple[str, str], Any] = {}
    routers: list[subprocess.Popen] = []
    try:
        for way in names:
            for role, (kv_role, cores, extra) in PLANS[way].items():
                log = log_dir / f"{way}-{role}.log"
                engines[way, role] = _engine(model, kv_role, cores, log, extra)
        for (way, role), engine in engines.items():
            progress(f"waiting for engine {way}/{role}")
            engine.wait_healthy(timeout_s=900)
        ways = {}
        for way in names:
            urls = {role: engines[way, role].spec.url for role in PLANS[way]}
            args = _router_args(way, urls)
            url = urls["engine"] if args is None else None
            if args is not None:
                router, url = _router(args, log_dir / f"{way}-router.log")
                routers.append(router)
            ways[way] = Way(way, str(url), list(urls.values()), list(urls))
        yield ways
    finally:
        for router in routers:
            router.terminate()
            router.wait(timeout=20)
        from vllm_hybrid_nixl.deploy.engines import stop_engines

        stop_engines(engines.values())


def progress(message: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


#: Histograms whose means split a request's time per engine: to the first token, waiting to
#: be scheduled, from scheduled to the first token, and (decode engines) NIXL reads.
STAGES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "nixl_read": "vllm:nixl_xfer_time_seconds",
}


@dataclass
class Scrape:
    """One engine's ``/metrics`` at a moment: ITL buckets (upper bound -> cumulative count)
    and, per stage, its histogram's (sum, count); label sets summed."""

    itl: dict[float, float] = field(default_factory=dict)
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    steps: float = 0.0  # engine steps whose outputs the API server processed
    step_tokens: float = 0.0  # tokens those steps computed (prompt and generated)
    generated: float = 0.0  # tokens generated


def scrape(engine_url: str) -> Scrape:
    return parse_scrape(httpx.get(f"{engine_url}/metrics", timeout=30).text)


def parse_scrape(text: str) -> Scrape:
    """The ITL buckets and stage (sum, count) pairs of one ``/metrics`` text."""
    found = Scrape()
    by_metric = {metric: stage for stage, metric in STAGES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{STEP_METRIC}_count":
                found.steps += sample.value
            elif sample.name == f"{STEP_METRIC}_sum":
                found.step_tokens += sample.value
            elif sample.name == GENERATED_METRIC:
                found.generated += sample.value
            if sample.name == f"{ITL_METRIC}_bucket":
                bound = float(sample.labels["le"])
                found.itl[bound] = found.itl.get(bound, 0.0) + sample.value
            for suffix, slot in (("_sum", 0), ("_count", 1)):
                stage = by_metric.get(sample.name.removesuffix(suffix))
                if stage and sample.name.endswith(suffix):
                    pair = list(found.stages.get(stage, (0.0, 0.0)))
                    pair[slot] += sample.value
                    found.stages[stage] = (pair[0], pair[1])
    return found


def step_figures(before: Scrape, after: Scrape) -> dict[str, float]:
    """An engine's steps between two scrapes, the tokens each computed and generated on
    average (its batch: with no prompt tokens, the requests it decoded a step)."""
    steps = after.steps - before.steps
    if steps <= 0:
        return {"steps": 0.0}
    return {
        "steps": steps,
        "tokens_per_step": (after.step_tokens - before.step_tokens) / steps,
        "generated_per_step": (after.generated - before.generated) / steps,
    }


def stage_means_ms(before: Scrape, after: Scrape) -> dict[str, float]:
    """Mean milliseconds per request of each stage the engine observed between two scrapes."""
    means = {}
    for stage, pair in after.stages.items():
        mean = mean_delta(before.stages.get(stage, (0.0, 0.0)), pair)
        if not math.isnan(mean):
            means[stage] = round(mean * 1e3, 1)
    return means


async def _one(client: httpx.AsyncClient, url: str, model: str, request: Request) -> Sample:
    body = {
        "model": model, "prompt": request.prompt, "max_tokens": request.output_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    seen: list[float] = []  # when each event carrying text arrived
    tokens = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            progress(f"HTTP {response.status_code} from {url}: {response.text[:200]}")
            return Sample(None)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                progress(f"an error event from {url}: {str(event['error'])[:200]}")
                return Sample(None)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices", [])):
                seen.append(time.perf_counter() - started)
    return sample_of(seen, tokens, request.output_tokens)


def sample_of(seen: list[float], tokens: int | None, wanted: int) -> Sample:
    """A request's sample from the times its text events arrived: unfinished (a miss) when
    none arrived or the stream's usage counts other than the ``wanted`` tokens (with
    ``ignore_eos`` a whole answer has exactly that many; a stream without a usage event is
    taken as whole)."""
    tokens = wanted if tokens is None else tokens
    if not seen or tokens != wanted:
        return Sample(None)
    gaps = [later - earlier for earlier, later in zip(seen, seen[1:], strict=False)]
    tpot = (seen[-1] - seen[0]) / (tokens - 1) if tokens > 1 else 0.0
    return Sample(seen[0], tpot, max(gaps, default=0.0))


async def run_stream(
    url: str, model: str, requests: list[Request], tail_s: float
) -> tuple[list[Sample], float, float]:
    """Sends each request at its arrival time (open loop); requests still running
    ``tail_s`` after the last arrival are cancelled and count as missing their SLOs.
    Returns the samples in arrival order, the run's seconds and the latest any request was
    sent after its arrival time (TTFT counts from the send)."""
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=8)
    late: list[float] = []
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        started = time.perf_counter()

        async def at_arrival(request: Request) -> Sample:
            await asyncio.sleep(max(0.0, request.at_s - (time.perf_counter() - started)))
            late.append(time.perf_counter() - started - request.at_s)
            try:
                return await _one(client, url, model, request)
            except Exception as exc:  # noqa: BLE001 - any failed request is a miss, by name
                progress(f"{type(exc).__name__} from {url}: {exc}")
                return Sample(None)

        tasks = [asyncio.create_task(at_arrival(r)) for r in requests]
        deadline = requests[-1].at_s + tail_s
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()  # closing the stream aborts the request in vLLM
        await asyncio.gather(*pending, return_exceptions=True)
        samples = [Sample(None) if t.cancelled() else t.result() for t in tasks]
        return samples, time.perf_counter() - started, max(late, default=0.0)


def summarize_run(
    samples: list[Sample], workload: Workload, itl: dict[float, float], seconds: float
) -> dict[str, Any]:
    done = [s for s in samples if s.finished]
    ttft = [s.ttft_s for s in done if s.ttft_s is not None]
    tpot = [s.tpot_s for s in done if s.tpot_s is not None]
    gaps = [s.max_gap_s for s in done if s.max_gap_s is not None]
    return {
        "requests": len(samples),
        "finished": len(done),
        "seconds": round(seconds, 1),
        "slo_attainment": attainment(samples, workload.ttft_slo_s, workload.gap_slo_s),
        "within_ttft_slo": sum(1 for t in ttft if t <= workload.ttft_slo_s) / len(samples),
        "within_gap_slo": sum(1 for g in gaps if g <= workload.gap_slo_s) / len(samples),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "max_gap_p50_ms": percentile(gaps, 50) * 1e3,
        "max_gap_p99_ms": percentile(gaps, 99) * 1e3,
        "engine_itl_p50_ms": histogram_quantile(itl, 0.50) * 1e3,
        "engine_itl_p99_ms": histogram_quantile(itl, 0.99) * 1e3,
        "engine_itl_count": itl.get(math.inf, 0.0),
        "ttft_s": ttft,
        "max_gap_ms": [g * 1e3 for g in gaps],
    }


def measure(
    ways: dict[str, Way], model: str, workload: Workload, count: int, tail_s: float,
    vocab: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    by_rate: dict[str, dict[str, Any]] = {}
    streams: dict[str, dict[str, Any]] = {}
    names = list(ways)
    for index, rate in enumerate(workload.rates):
        requests = arrivals(workload, rate, count, seed=seed * 1000 + index, vocab=vocab)
        order = names[index % len(names) :] + names[: index % len(names)]
        row: dict[str, Any] = {}
        for name in order:
            way = ways[name]
            before = [scrape(url) for url in way.engines]
            progress(f"{workload.name} at {rate}/s: {name} ({count} requests)")
            samples, seconds, late = asyncio.run(run_stream(way.url, model, requests, tail_s))
            after = [scrape(url) for url in way.engines]
            pairs = list(zip(before, after, strict=True))
            itl = summed_buckets(histogram_delta(b.itl, a.itl) for b, a in pairs)
            row[name] = summarize_run(samples, workload, itl, seconds)
            row[name]["latest_send_after_arrival_ms"] = round(late * 1e3, 1)
            row[name]["engine_stage_means_ms"] = {
                role: stage_means_ms(b, a) for role, (b, a) in zip(way.roles, pairs, strict=True)
            }
            progress(
                f"  {name}: {row[name]['finished']}/{count} finished, within SLO "
                f"{row[name]['slo_attainment']:.0%}, TTFT p50 {row[name]['ttft_p50_s']:.2f} s, "
                f"engine ITL p99 {row[name]['engine_itl_p99_ms']:.0f} ms"
            )
        streams[str(rate)] = {
            "realized_rate": round(len(requests) / requests[-1].at_s, 3),  # 20 draws: noisy
            "arrivals_s": [round(r.at_s, 3) for r in requests],
        }
        by_rate[str(rate)] = row
    rates = list(workload.rates)
    share = {w: [by_rate[str(r)][w]["slo_attainment"] for r in rates] for w in names}
    return {
        "workload": workload.__dict__,
        "requests_per_rate": count,
        "by_rate": by_rate,
        "arrival_streams": streams,
        "goodput_rps": {w: goodput_rate(list(zip(rates, share[w], strict=True))) for w in names},
        "crossover_rps_pd_vs": {
            other: crossover_rate(rates, share["pd"], share[other])
            for other in names
            if other.startswith("colocated") and "pd" in share
        },
    }


def warm_up(ways: dict[str, Way], model: str, vocab: int) -> None:
    """Two untimed requests per way (P/D's first one makes the NIXL handshake)."""
    warm = Workload("warm-up", (200, 200), (4, 4), (1.0,), math.inf, math.inf)
    for way in ways.values():
        requests = arrivals(warm, 1.0, 2, seed=999_999, vocab=vocab)
        samples, _, _ = asyncio.run(run_stream(way.url, model, requests, tail_s=300))
        if any(s.ttft_s is None for s in samples):
            raise RuntimeError(f"{way.name}: a warm-up request failed; see the logs")


def run(
    workloads: list[Workload], names: list[str], count: int, tail_s: float, seed: int,
    log_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    from vllm_hybrid_nixl.tools.tiny_model import build_tiny_model

    spec = bench_model_spec()
    model = str(build_tiny_model(log_dir / "model", spec))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    shape = model_shape(spec)
    result: dict[str, Any] = {
        "model": {**spec.__dict__, "shape": shape.summary()},
        "real_model_for_comparison": {"llama-3-8b": LLAMA3_8B.summary()},
        "ways": {name: PLANS[name] for name in names},
        "attainment_goal": ATTAINMENT_GOAL,
        "workloads": {},
    }
    with serving_ways(model, log_dir, names) as ways:
        warm_up(ways, model, vocab)
        for number, workload in enumerate(workloads):
            result["workloads"][workload.name] = measure(
                ways, model, workload, count, tail_s, vocab, seed + number
            )
    return result


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per workload: each way's goodput, P/D's over each colocated way's, and the crossover
    rate between them."""
    top: dict[str, Any] = {}
    for name, workload in result["workloads"].items():
        goodput = workload["goodput_rps"]
        for way, rate in goodput.items():
            top[f"goodput_{name}_{way}_rps"] = rate
        for other, crossover in workload["crossover_rps_pd_vs"].items():
            base = goodput[other]
            top[f"goodput_{name}_pd_vs_{other}"] = goodput["pd"] / base if base else None
            top[f"goodput_{name}_crossover_rps_vs_{other}"] = crossover
    return top


def table(result: dict[str, Any]) -> str:
    lines = []
    for name, workload in result["workloads"].items():
        spec = workload["workload"]
        lines.append(
            f"{name}: prompts {spec['prompt_tokens']} tokens, outputs {spec['output_tokens']}, "
            f"SLO TTFT <= {spec['ttft_slo_s']} s and no gap between tokens over "
            f"{spec['gap_slo_s'] * 1e3:.0f} ms"
        )
        lines.append(
            f"{'rate/s':>7} {'way':>13} {'in SLO':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'gap p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
        )
        for rate, row in workload["by_rate"].items():
            for way, r in row.items():
                lines.append(
                    f"{rate:>7} {way:>13} {r['slo_attainment']:>7.0%} {r['ttft_p50_s']:>8.2f}s "
                    f"{r['ttft_p99_s']:>8.2f}s {r['max_gap_p99_ms']:>7.0f}ms "
                    f"{r['engine_itl_p50_ms']:>6.0f}ms {r['engine_itl_p99_ms']:>6.0f}ms"
                )
        goodput = ", ".join(f"{w} {v:g}/s" for w, v in workload["goodput_rps"].items())
        lines.append(
            f"goodput (>= {result['attainment_goal']:.0%} in SLO): {goodput}; crossover "
            f"rate of P/D against: {workload['crossover_rps_pd_vs']}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Per workload: SLO attainment, TTFT p99, the p99 of each request's longest gap between
    tokens and the engines' ITL p99 against the arrival rate, one line per way (needs
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(result["workloads"])
    fig, axes = plt.subplots(len(names), 4, figsize=(18, 3.8 * len(names)), squeeze=False)
    for row_axes, name in zip(axes, names, strict=True):
        workload = result["workloads"][name]
        rates = [float(r) for r in workload["by_rate"]]
        for way in result["ways"]:
            rows = [workload["by_rate"][r][way] for r in workload["by_rate"]]
            row_axes[0].plot(rates, [100 * r["slo_attainment"] for r in rows], "o-", label=way)
            row_axes[1].plot(rates, [r["ttft_p99_s"] for r in rows], "o-", label=way)
            row_axes[2].plot(rates, [r["max_gap_p99_ms"] for r in rows], "o-", label=way)
            row_axes[3].plot(rates, [r["engine_itl_p99_ms"] for r in rows], "o-", label=way)
        spec = workload["workload"]
        row_axes[0].axhline(100 * result["attainment_goal"], color="grey", linestyle=":")
        row_axes[0].set(xlabel="arrivals per second", ylabel="% within SLO", title=name)
        row_axes[1].axhline(spec["ttft_slo_s"], color="grey", linestyle=":")
        row_axes[1].set(xlabel="arrivals per second", ylabel="TTFT p99 (s)", yscale="log")
        row_axes[2].axhline(spec["gap_slo_s"] * 1e3, color="grey", linestyle=":")
        row_axes[2].set(xlabel="arrivals per second", ylabel="longest token gap p99 (ms)")
        row_axes[3].set(xlabel="arrivals per second", ylabel="engine ITL p99 (ms)")
        for axis in row_axes:
            axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def smoke_version(workload: Workload) -> Workload:
    return Workload(workload.name, (64, 256), (4, 8), (2.0,), workload.ttft_slo_s,
                    workload.gap_slo_s)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="requests per way and rate")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--rates", type=float, nargs="+", help="override every workload's rates")
    parser.add_argument(
        "--ways", nargs="+", choices=list(PLANS), default=list(WAYS),
        help="ways of serving to compare, side by side (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--stem", default="goodput", help="results file names: STEM.json, STEM.png")
    parser.add_argument(
        "--tail-s", type=float, default=90.0,
        help="seconds after the last arrival before unfinished requests are cancelled (missed)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--smoke", action="store_true",
        help="every part at its smallest (short prompts and outputs, one rate, 3 requests): "
        "checks the bench runs, measures nothing",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args()
    workloads = [WORKLOADS[name] for name in args.workloads]
    if args.smoke:
        workloads = [smoke_version(w) for w in workloads]
        args.requests = min(args.requests, 3)
    if args.rates:
        workloads = [Workload(**{**w.__dict__, "rates": tuple(args.rates)}) for w in workloads]
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="goodput-"))
    progress(f"model, engine and router logs under {log_dir} (removed after a clean run)")
    result = run(workloads, args.ways, args.requests, args.tail_s, args.seed, log_dir)
    shutil.rmtree(log_dir)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["headline"] = headline(result)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.stem}_smoke" if args.smoke else args.stem  # a smoke run keeps the results
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{name}.png")
    if not args.smoke and args.stem == "goodput":
        refresh_latest(result["headline"], args.out / "latest.json", section="goodput")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
