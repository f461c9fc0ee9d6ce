"""The router's own cost, engines taken out: CPU per request of our router and of vllm-router
in front of the same two model-free OpenAI servers, side by side, alternating.

    python -m bench.router_overhead [--concurrency 8 32] [--requests 300] [--rounds 3]

Why model-free servers: with real engines on this machine's two cores, round-to-round swings
(up to 2x for the same router) hide a router's CPU, and a load generator's start-up idles the
router for seconds that then count as "per request". Here the upstream is what vLLM's API
server is without a model — FastAPI on uvicorn answering a prefill leg with
``kv_transfer_params`` and a decode leg with a server-sent-event stream, one event per token
``--gap-ms`` apart (what the router relays chunk by chunk) — and the load is a closed loop of
streamed completions from an aiohttp client. What this measures is only the routers' own
work per request (legs, relay, bookkeeping); the end-to-end comparison on real engines is
``bench.router_peer``. Each router's idle CPU (probes, timers) is measured too, on its own.

Writes ``router_overhead.json`` under ``bench/results/`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.end_to_end import RESULTS, wait_for_health
from bench.router_peer import cpu_seconds, start_vllm_router
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.common.processes import die_with_parent

TARGETS = ("ours", "vllm_router")
IDLE_S = 10.0


# ---- the model-free upstream (runs in its own process: python -m bench.router_overhead serve)


def upstream_app(tokens: int, gap_s: float) -> Any:
    """vLLM's HTTP surface without a model: the legs a P/D router sends, answered at once."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/version")
    async def version() -> dict:
        return {"version": "model-free"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "model-free", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        request_id = uuid.uuid4().hex
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return JSONResponse(prefill_answer(body["model"], request_id))
        return StreamingResponse(
            decode_events(body["model"], request_id, tokens, gap_s),
            media_type="text/event-stream",
        )

    return app


def prefill_answer(model: str, request_id: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 256, "completion_tokens": 1, "total_tokens": 257},
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3, 4]],
            "remote_engine_id": "model-free",
            "remote_request_id": request_id,
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        },
    }


async def decode_events(
    model: str, request_id: str, tokens: int, gap_s: float
) -> AsyncIterator[bytes]:
    for _ in range(tokens):
        await asyncio.sleep(gap_s)
        event = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}],
        }
        yield b"data: " + json.dumps(event).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def serve_upstream(port: int, tokens: int, gap_s: float) -> None:
    uvicorn.run(
        upstream_app(tokens, gap_s),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        http="httptools",
    )


# ---- the load -------------------------------------------------------------------------------


async def closed_loop(url: str, concurrency: int, requests: int, tokens: int) -> dict[str, Any]:
    """``requests`` streamed completions, ``concurrency`` at a time; counts what came back."""
    body = {"model": "model-free", "prompt": "hello " * 200, "max_tokens": tokens, "stream": True}
    left, ok, failed = requests, 0, 0
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal left, ok, failed
            while left > 0:
                left -= 1
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    payload = await response.read()
                if response.status == 200 and payload.rstrip().endswith(b"data: [DONE]"):
                    ok += 1
                else:
                    failed += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"ok": ok, "failed": failed, "seconds": time.perf_counter() - started}


# ---- the comparison --------------------------------------------------------------------------


@contextmanager
def upstreams(tokens: int, gap_s: float, log_dir: Path) -> Iterator[tuple[str, str]]:
    """Two model-free servers (prefill, decode), stopped by PID."""
    processes, urls = [], []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            with open(log_dir / f"{role}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.router_overhead",
                            "serve",
                            str(port),
                            str(tokens),
                            str(gap_s),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        preexec_fn=die_with_parent,
                        cwd=Path(__file__).resolve().parents[1],
                    )
                )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_for_health(url, processes)
        yield urls[0], urls[1]
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)


@contextmanager
def our_router(prefill: str, decode: str, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    script = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [script, "router", "--port", str(port), "--prefill", prefill, "--decode", decode],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, [process])
        yield process, url
    finally:
        process.terminate()
        process.wait(timeout=20)


def run(concurrency: list[int], requests: int, rounds: int, tokens: int, gap_s: float,
        log_dir: Path) -> dict[str, Any]:  # fmt: skip
    runs: list[dict[str, Any]] = []
    idle: dict[str, float] = {}
    with upstreams(tokens, gap_s, log_dir) as (prefill, decode):
        with our_router(prefill, decode, log_dir / "ours.log") as (ours, ours_url):
            peer, peer_url = start_vllm_router(prefill, decode, log_dir / "vllm-router.log")
            try:
                urls = {"ours": ours_url, "vllm_router": peer_url}
                pids = {"ours": ours.pid, "vllm_router": peer.pid}
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                time.sleep(IDLE_S)
                for name, pid in pids.items():
                    idle[name] = (cpu_seconds(pid) - before[name]) / IDLE_S * 1000
                for round_index in range(rounds):
                    for c in concurrency:
                        order = TARGETS if round_index % 2 == 0 else TARGETS[::-1]
                        for target in order:
                            asyncio.run(closed_loop(urls[target], c, min(requests, 4 * c), tokens))
                            spent = cpu_seconds(pids[target])
                            load = asyncio.run(closed_loop(urls[target], c, requests, tokens))
                            spent = cpu_seconds(pids[target]) - spent
                            runs.append({
                                "round": round_index, "target": target, "concurrency": c,
                                **load,
                                "requests_per_s": load["ok"] / load["seconds"],
                                "router_cpu_ms_per_request": spent * 1000 / max(load["ok"], 1),
                            })  # fmt: skip
                            print(
                                f"  round {round_index + 1}, c={c}, {target}: "
                                f"{runs[-1]['requests_per_s']:.0f} req/s, router CPU "
                                f"{runs[-1]['router_cpu_ms_per_request']:.2f} ms/request",
                                file=sys.stderr,
                                flush=True,
                            )
            finally:
                peer.terminate()
                peer.wait(timeout=20)
    return {
        "tokens_per_request": tokens,
        "token_gap_ms": gap_s * 1000,
        "requests_per_run": requests,
        "rounds": rounds,
        "idle_cpu_ms_per_s": idle,
        "runs": runs,
        "by_concurrency": summarize(runs, concurrency),
    }


def summarize(runs: list[dict[str, Any]], concurrency: list[int]) -> dict[str, Any]:
    """Medians over rounds, and ours / vllm-router for CPU per request."""
    table: dict[str, Any] = {}
    for c in concurrency:
        row: dict[str, Any] = {}
        for target in TARGETS:
            mine = [r for r in runs if r["target"] == target and r["concurrency"] == c]
            row[target] = {
                "router_cpu_ms_per_request": statistics.median(
                    r["router_cpu_ms_per_request"] for r in mine
                ),
                "requests_per_s": statistics.median(r["requests_per_s"] for r in mine),
                "failed": sum(r["failed"] for r in mine),
            }
        peer_cpu = row["vllm_router"]["router_cpu_ms_per_request"]
        row["cpu_ours_vs_vllm_router"] = (
            row["ours"]["router_cpu_ms_per_request"] / peer_cpu if peer_cpu > 0 else None
        )
        table[str(c)] = row
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve_upstream(int(argv[1]), int(argv[2]), float(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests", type=int, default=300, help="streamed requests per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="events per decode stream")
    parser.add_argument("--gap-ms", type=float, default=15.0, help="between decode events")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(
            args.concurrency, args.requests, args.rounds, args.tokens, args.gap_ms / 1000, Path(tmp)
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    idle = result["idle_cpu_ms_per_s"]
    print(f"idle CPU: ours {idle['ours']:.1f} ms/s, vllm-router {idle['vllm_router']:.1f} ms/s")
    for c, row in result["by_concurrency"].items():
        print(
            f"c={c}: router CPU per request ours {row['ours']['router_cpu_ms_per_request']:.2f} "
            f"ms, vllm-router {row['vllm_router']['router_cpu_ms_per_request']:.2f} ms "
            f"({row['cpu_ours_vs_vllm_router']:.2f}x); failed {row['ours']['failed']} / "
            f"{row['vllm_router']['failed']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
