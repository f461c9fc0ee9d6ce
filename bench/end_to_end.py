"""End to end on this machine: the router (1P1D) against the same two legs sent by the client
itself, and against a colocated engine, side by side in one run.

One prefill and one decode ``vllm serve`` (tiny hybrid model, a core each), the router as its
own process (``vllm-hybrid-nixl router``), as deployed. For each concurrency the three ways of
serving take turns, round after round, so machine noise hits all alike:

- ``router``: POST to the router (prefill leg + decode leg behind it);
- ``client_legs``: the bench sends the same two legs itself (what the router does, without it);
- ``colocated``: the decode engine answers the request alone (no P/D).

Router overhead = router minus client_legs (latency of whole requests, p50 and p99); TTFT of
P/D against colocated from streamed requests. The inter-token time is the decode engine's own
(``vllm:inter_token_latency_seconds``, finer buckets, its delta over each way's rounds): a
client on the same two cores reads a stream late and sees tokens bunched (the 0.00 ms rows
this table once showed at 32 concurrent).

    python -m bench.end_to_end [--concurrency 1 8 32 64] [--rounds 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy

from vllm_hybrid_nixl.connector.progress_pacing import DEFAULT_POLL_US, POLL_KEY
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.pd_client import prefill_body

RESULTS = Path(__file__).parent / "results"
WAYS = ("router", "client_legs", "colocated")
MAX_MODEL_LEN = 1024
SINGLE_REQUEST_ROUNDS = 5  # rounds multiplier at concurrency 1


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the nearest ranks
    (numpy's default); NaN for none."""
    return float(numpy.percentile(values, q)) if values else float("nan")


async def timed_request(
    client: httpx.AsyncClient, way: str, urls: dict[str, str], body: dict[str, Any]
) -> tuple[float, float, float]:
    """(seconds to the whole answer, seconds to the first streamed token, seconds between
    tokens after the first, averaged)."""
    started = time.perf_counter()
    if way == "client_legs":
        first = await client.post(f"{urls['prefill']}/v1/completions", json=prefill_body(body))
        first.raise_for_status()
        body = {**body, "kv_transfer_params": first.json()["kv_transfer_params"]}
        url = urls["decode"]
    else:
        url = urls["router"] if way == "router" else urls["decode"]
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - started)
    if not arrivals:
        raise RuntimeError(f"{way}: no token streamed from {url}")
    itl = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan
    return time.perf_counter() - started, arrivals[0], itl


async def one_round(
    way: str, urls: dict[str, str], bodies: list[dict[str, Any]]
) -> list[tuple[float, float, float]]:
    limits = httpx.Limits(max_connections=len(bodies) * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(timed_request(client, way, urls, b) for b in bodies))


def bodies_for(
    model: str, concurrency: int, max_tokens: int, words: int, tag: str = ""
) -> list[dict]:
    """``concurrency`` streamed requests of ``words`` repeated words; ``tag`` leads each
    prompt, so requests tagged apart share no cached block (vLLM's prefix cache is per
    64-token block, chained from the first)."""
    return [
        {
            "model": model,
            "prompt": f"{tag}request {i}: " + " ".join(["hybrid kv cache blocks move"] * words),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        for i in range(concurrency)
    ]


def measure(
    urls: dict[str, str], model: str, concurrency: list[int], rounds: int, max_tokens: int
) -> list[dict[str, Any]]:
    from bench.goodput import scrape
    from bench.goodput_stats import histogram_delta, histogram_quantile, summed_buckets

    rows = []
    for c in concurrency:
        samples: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
        itl_deltas: dict[str, list[dict[float, float]]] = {way: [] for way in WAYS}
        # One request at a time gives one sample per round: take more rounds there, the P/D
        # path's latency is heavy-tailed (stalls of hundreds of ms) on a shared 2-core box.
        # Every (round, way) gets prompts of its own: with shared ones, client_legs found the
        # router's prefill cached on the prefill engine and colocated found the KV P/D had
        # moved on the decode engine. The order of the ways rotates round by round.
        for r in range(rounds * SINGLE_REQUEST_ROUNDS if c == 1 else rounds):
            shift = r % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
                tag = f"c{c} r{r} w{WAYS.index(way)} "
                bodies = bodies_for(model, c, max_tokens, words=8 + r, tag=tag)
                before = scrape(urls["decode"]).itl
                samples[way] += asyncio.run(one_round(way, urls, bodies))
                itl_deltas[way].append(histogram_delta(before, scrape(urls["decode"]).itl))
        row: dict[str, Any] = {"concurrency": c}
        for way in WAYS:
            itl_buckets = summed_buckets(itl_deltas[way])
            total = [s[0] for s in samples[way]]
            ttft = [s[1] for s in samples[way]]
            itl = [s[2] for s in samples[way] if not math.isnan(s[2])]
            row[way] = {
                "p50_s": statistics.median(total),
                "p99_s": percentile(total, 99),
                "ttft_p50_s": statistics.median(ttft),
                # the decode engine's own inter-token times over this way's rounds
                "itl_p50_ms": histogram_quantile(itl_buckets, 0.5) * 1e3,
                "itl_p99_ms": histogram_quantile(itl_buckets, 0.99) * 1e3,
                # what the client saw: events it read, apart (bunched when it reads late)
                "client_itl_p50_ms": statistics.median(itl) * 1e3 if itl else math.nan,
                # output tokens per second over the round: every request's tokens / p50 time
                "tokens_per_s": c * max_tokens / statistics.median(total),
            }
        row["router_overhead_ms_p50"] = (row["router"]["p50_s"] - row["client_legs"]["p50_s"]) * 1e3
        row["router_overhead_ms_p99"] = (row["router"]["p99_s"] - row["client_legs"]["p99_s"]) * 1e3
        row["router_vs_client_legs_p50"] = row["router"]["p50_s"] / row["client_legs"]["p50_s"]
        row["router_vs_client_legs_p99"] = row["router"]["p99_s"] / row["client_legs"]["p99_s"]
        row["pd_vs_colocated_ttft"] = row["router"]["ttft_p50_s"] / row["colocated"]["ttft_p50_s"]
        row["pd_vs_colocated_itl"] = row["router"]["itl_p50_ms"] / row["colocated"]["itl_p50_ms"]
        row["pd_vs_colocated_tokens_per_s"] = (
            row["router"]["tokens_per_s"] / row["colocated"]["tokens_per_s"]
        )
        print(
            f"  concurrency {c}: router p50 {row['router']['p50_s'] * 1e3:.0f} ms, client legs "
            f"{row['client_legs']['p50_s'] * 1e3:.0f} ms, colocated "
            f"{row['colocated']['p50_s'] * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def slope_stderr(xs: list[float], ys: list[float]) -> float:
    """Standard error of :func:`slope` (from the residuals; NaN with fewer than 3 points)."""
    if len(xs) < 3:
        return math.nan
    fitted = slope(xs, ys)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    residuals = [y - mean_y - fitted * (x - mean_x) for x, y in zip(xs, ys, strict=True)]
    spread = sum((x - mean_x) ** 2 for x in xs)
    return math.sqrt(sum(r * r for r in residuals) / (len(xs) - 2) / spread)


def prompt_scaling(
    urls: dict[str, str], model: str, words: list[int], rounds: int
) -> dict[str, Any]:
    """TTFT through the router (P/D: prefill, then the KV moved over NIXL) and colocated, one
    request at a time, for growing prompts; slopes in ms per 1,000 prompt tokens. Each way
    gets a prompt of its own (same length, another first line): with one prompt for both,
    the colocated request found the KV the P/D one had just moved in the decode engine's
    prefix cache and computed nothing. For each P/D request the decode engine's own NIXL
    counters give the bytes it read and the time its reads took, so the TTFT P/D adds per
    1,000 tokens (its slope over colocated's) can be set against the transfer those tokens
    need; each row also has the engines' own stage means for its P/D requests
    (``bench.goodput.STAGES``)."""
    from bench.goodput import scrape, stage_means_ms

    rows = []
    for n in words:
        ttft: dict[str, list[float]] = {"router": [], "colocated": []}
        moved_bytes: list[float] = []
        xfer_ms: list[float] = []
        stages: dict[str, list[float]] = {}
        tokens = 0
        for r in range(rounds):
            base = bodies_for(model, 1, 4, n)[0]
            prompts = {
                way: f"scaling {n} round {r} way {i}: {base['prompt']}"
                for i, way in enumerate(ttft)
            }
            tokens = count_tokens(urls["decode"], model, prompts["router"])
            if tokens + 4 > MAX_MODEL_LEN:
                break
            for way in list(ttft) if r % 2 == 0 else list(ttft)[::-1]:
                body = {**base, "prompt": prompts[way]}
                if way != "router":
                    ttft[way].append(asyncio.run(one_round(way, urls, [body]))[0][1])
                    continue
                before = read_kv_transfer_counters(urls["decode"])
                scraped = {role: scrape(urls[role]) for role in ("prefill", "decode")}
                ttft[way].append(asyncio.run(one_round(way, urls, [body]))[0][1])
                moved = read_kv_transfer_counters(urls["decode"]) - before
                moved_bytes.append(moved.nixl_bytes)
                xfer_ms.append(moved.nixl_xfer_s * 1e3)
                for role, earlier in scraped.items():
                    for stage, ms in stage_means_ms(earlier, scrape(urls[role])).items():
                        stages.setdefault(f"pd_{role}_{stage}_ms", []).append(ms)
        if ttft["router"]:
            rows.append(
                {
                    "words": n,
                    "prompt_tokens": tokens,
                    **{f"{way}_ttft_ms": statistics.median(v) * 1e3 for way, v in ttft.items()},
                    "pd_kv_bytes": statistics.median(moved_bytes),
                    "pd_nixl_xfer_ms": statistics.median(xfer_ms),
                    **{name: statistics.median(v) for name, v in sorted(stages.items())},
                }
            )
    result: dict[str, Any] = {"rows": rows}
    if len(rows) >= 2:
        xs = [row["prompt_tokens"] / 1000 for row in rows]
        for way in ("router", "colocated"):
            ys = [row[f"{way}_ttft_ms"] for row in rows]
            result[f"{way}_ttft_ms_per_1k_tokens"] = slope(xs, ys)
        result["pd_added_ttft_ms_per_1k_tokens"] = (
            result["router_ttft_ms_per_1k_tokens"] - result["colocated_ttft_ms_per_1k_tokens"]
        )
        # how far the rows let the added slope be told apart from zero (standard error)
        result["pd_added_ttft_ms_per_1k_tokens_stderr"] = slope_stderr(
            xs, [row["router_ttft_ms"] - row["colocated_ttft_ms"] for row in rows]
        )
        result["kv_bytes_per_1k_tokens"] = slope(xs, [row["pd_kv_bytes"] for row in rows])
        result["nixl_xfer_ms_per_1k_tokens"] = slope(xs, [row["pd_nixl_xfer_ms"] for row in rows])
        for stage in ("pd_prefill_ttft_ms", "pd_decode_ttft_ms", "pd_decode_queue_ms"):
            if all(stage in row for row in rows):  # the engines' own, per P/D request
                per_1k = stage.removesuffix("_ms") + "_ms_per_1k_tokens"
                result[per_1k] = slope(xs, [row[stage] for row in rows])
                result[f"{per_1k}_stderr"] = slope_stderr(xs, [row[stage] for row in rows])
    return result


def transfer_ms_at(bandwidth_gbs: float, kv_bytes: float) -> float:
    """Milliseconds ``kv_bytes`` take at ``bandwidth_gbs`` (GB/s, 10^9 bytes)."""
    return kv_bytes / (bandwidth_gbs * 1e9) * 1e3


def set_against_bandwidth(scaling: dict[str, Any], transfer_results: Path) -> dict[str, Any]:
    """The TTFT P/D adds per 1,000 prompt tokens over colocated, as a multiple of the time
    those tokens' KV bytes take at the NIXL bandwidth ``bench.transfer`` measured (its median
    over block sizes) and of the time the decode engine's own reads took."""
    if "kv_bytes_per_1k_tokens" not in scaling or not transfer_results.exists():
        return {}
    rates = [row["nixl_gbs"] for row in json.loads(transfer_results.read_text())["blocks"]]
    bandwidth = statistics.median(rates)
    wire_ms = transfer_ms_at(bandwidth, scaling["kv_bytes_per_1k_tokens"])
    added = scaling["pd_added_ttft_ms_per_1k_tokens"]
    stderr = scaling.get("pd_added_ttft_ms_per_1k_tokens_stderr", math.nan)
    # an added slope within two standard errors of zero is not told apart from none: no ratio
    within_noise = not math.isnan(stderr) and abs(added) < 2 * stderr
    xfer = scaling["nixl_xfer_ms_per_1k_tokens"]
    return {
        "transfer_bench_nixl_gbs": bandwidth,
        "transfer_ms_per_1k_tokens_at_bench_rate": wire_ms,
        "pd_added_within_noise": within_noise,
        "pd_added_vs_transfer_at_bench_rate": (
            added / wire_ms if wire_ms > 0 and not within_noise else math.nan
        ),
        "pd_added_vs_engine_xfer": added / xfer if xfer > 0 and not within_noise else math.nan,
    }


def count_tokens(url: str, model: str, prompt: str) -> int:
    response = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    response.raise_for_status()
    return int(response.json()["count"])


def wait_for_health(url: str, processes: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Return once ``url``/health answers 200; raise if one of ``processes`` exits first or
    the time runs out."""
    from vllm_hybrid_nixl.deploy.engines import answers_health

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a process exited before {url} answered")
        if answers_health(url):
            return
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer /health within {timeout_s:.0f} s")


#: The benchmark's engines pace NIXL's progress thread (``progress_poll_us``, opt-in).
PACED = {POLL_KEY: DEFAULT_POLL_US}


#: Unconfined engines keep one compute thread each and let the OS place it. With vLLM's default
#: binding (``auto``) two engines on two cores each bind an OpenMP team to both cores (the
#: reserve of 2 leaves nothing, vLLM only warns) and the first P/D request's decode worker
#: stalled ("No available shared memory broadcast block found in 60 seconds"; measured: no
#: answer in 120 s, against 0.33 s with these settings).
UNCONFINED_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def start_stack(
    model: str,
    log_dir: Path,
    kv_extra_config: dict | None = None,
    with_router_pid: bool = False,
    confine_cores: bool = True,
    engine_args: list[str] | None = None,
):
    """Prefill and decode engines (a core each, or none with ``confine_cores`` False: as a
    plain ``vllm serve`` starts; ``engine_args`` added to both command lines) and the router
    process; returns (urls, stop), and the router's PID after them when asked."""
    from bench.goodput import ITL_BUCKETS
    from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
    from vllm_hybrid_nixl.common.processes import die_with_parent
    from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec
    from vllm_hybrid_nixl.deploy.keepalive import router_keep_alive_s

    args = ["--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "64"]
    args += ["--custom-histogram-buckets", json.dumps({"inter_token_latency": ITL_BUCKETS})]
    args += engine_args or []
    engines = [
        EngineProcess(
            EngineSpec(
                model=model,
                port=free_port(),
                role=role,
                side_channel_port=free_side_channel_port(),
                cpu_core=core if confine_cores else None,
                extra_args=list(args),
                kv_extra_config={**PACED, **(kv_extra_config or {})},
                env={} if confine_cores else dict(UNCONFINED_ENV),
            ),
            log_dir / f"{role}.log",
        ).start()
        for core, role in enumerate(("prefill", "decode"))
    ]
    for engine in engines:
        engine.wait_healthy(timeout_s=600)
    port = free_port()
    script = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))
    with open(log_dir / "router.log", "wb") as log:
        router = subprocess.Popen(
            [
                script, "router", "--port", str(port),
                "--prefill", engines[0].spec.url, "--decode", engines[1].spec.url,
                # what `serve` gives the router in front of engines it starts (keepalive.py)
                "--keepalive-expiry-s", str(router_keep_alive_s({})),
            ],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ}, start_new_session=True,
            preexec_fn=die_with_parent,  # a bench stopped by a signal leaves no router
        )  # fmt: skip
    urls = {
        "prefill": engines[0].spec.url,
        "decode": engines[1].spec.url,
        "router": f"http://127.0.0.1:{port}",
    }

    def stop() -> None:
        router.terminate()
        router.wait(timeout=20)
        from vllm_hybrid_nixl.deploy.engines import stop_engines

        stop_engines(engines)

    try:
        wait_for_health(urls["router"], [router])
    except RuntimeError:
        stop()
        raise RuntimeError(f"the router did not come up; see {log_dir / 'router.log'}") from None
    return (urls, stop, router.pid) if with_router_pid else (urls, stop)


def measure_stack(
    urls: dict[str, str],
    model: str,
    concurrency: list[int],
    rounds: int,
    max_tokens: int,
    scaling_words: list[int] | None = None,
) -> dict[str, Any]:
    """The end-to-end measurements on a running stack (:func:`start_stack`'s ``urls``)."""
    # warm-up: the first NIXL transfer between two engines sets up their connection
    asyncio.run(one_round("router", urls, bodies_for(model, 1, 2, 4)))
    rows = measure(urls, model, concurrency, rounds, max_tokens)
    scaling = prompt_scaling(urls, model, scaling_words or [], rounds)
    return {"max_tokens": max_tokens, "rounds": rounds, "rows": rows, "prompt_scaling": scaling}


@dataclass
class TinyStack:
    """A running stack of the default tiny hybrid: its model, URLs, router PID, work folder
    and how long the engines took to come up."""

    model: str
    urls: dict[str, str]
    router_pid: int
    work: Path
    start_s: float


@contextmanager
def tiny_stack(
    kv_extra_config: dict | None = None,
    confine_cores: bool = True,
    spec: Any = None,
    engine_args: list[str] | None = None,
) -> Iterator[TinyStack]:
    """A tiny model (the default tiny hybrid, or ``spec``, a ``TinyModelSpec``) built in a
    temporary folder and :func:`start_stack` on it; stopped (by PID) on exit."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = str(build_tiny_model(work / "model", spec or TinyModelSpec()))
        started = time.monotonic()
        urls, stop, router_pid = start_stack(
            model,
            work,
            kv_extra_config,
            with_router_pid=True,
            confine_cores=confine_cores,
            engine_args=engine_args,
        )
        try:
            yield TinyStack(model, urls, router_pid, work, time.monotonic() - started)
        finally:
            stop()


def run(
    concurrency: list[int],
    rounds: int,
    max_tokens: int,
    kv_extra_config: dict | None = None,
    scaling_words: list[int] | None = None,
) -> dict[str, Any]:
    """:func:`measure_stack` on a stack of its own, started and stopped here."""
    with tiny_stack(kv_extra_config) as stack:
        result = measure_stack(
            stack.urls, stack.model, concurrency, rounds, max_tokens, scaling_words
        )
    return {**result, "engine_start_s": stack.start_s, "kv_extra_config": kv_extra_config or {}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--busy-progress-thread",
        action="store_true",
        help="leave NIXL's progress thread at normal priority (the stock behaviour)",
    )
    parser.add_argument("--out", default="end_to_end.json", help="file name under results/")
    parser.add_argument(
        "--scaling-words",
        type=int,
        nargs="+",
        default=[],
        help="also time single requests of these prompt sizes (words), P/D and colocated",
    )
    parser.add_argument(
        "--scaling-only",
        action="store_true",
        help="only the prompt-size runs (no concurrency rows); the P/D TTFT added per 1,000 "
        "tokens is set against the transfer those tokens need (results/transfer.json's rate)",
    )
    args = parser.parse_args()
    extra = {"idle_progress_thread": False} if args.busy_progress_thread else None
    if args.scaling_only:
        words = args.scaling_words or [8, 48, 96, 144]
        result = run([], args.rounds, args.max_tokens, extra, scaling_words=words)
        scaling = result["prompt_scaling"]
        scaling.update(set_against_bandwidth(scaling, RESULTS / "transfer.json"))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in scaling.items() if k != "rows"}, indent=2))
        return 0
    result = run(args.concurrency, args.rounds, args.max_tokens, extra, args.scaling_words)
    print(f"engines healthy after {result['engine_start_s']:.0f}s", file=sys.stderr)
    print(f"{'conc':>4} {'router p50':>10} {'legs p50':>9} {'added p50':>9} {'added p99':>9} "
          f"{'p50 x':>6} {'p99 x':>6} {'TTFT P/D:co':>11}")  # fmt: skip
    for row in result["rows"]:
        print(
            f"{row['concurrency']:>4} {row['router']['p50_s'] * 1e3:>8.0f}ms "
            f"{row['client_legs']['p50_s'] * 1e3:>7.0f}ms {row['router_overhead_ms_p50']:>7.1f}ms "
            f"{row['router_overhead_ms_p99']:>7.1f}ms {row['router_vs_client_legs_p50']:>6.3f} "
            f"{row['router_vs_client_legs_p99']:>6.3f} {row['pd_vs_colocated_ttft']:>11.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
