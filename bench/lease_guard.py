"""What the KV lease guard costs a request: TTFT through P/D with the guard against without
it, side by side in one run.

One decode engine and two prefill engines (tiny hybrid model, HybridNixlConnector): one
prefill with the guard on, one with ``lease_guard: false`` (its answers carry no lease, so
the decode engine pins nothing for them). Requests alternate between the two, one at a time,
~256-token prompts; TTFT = from the prefill leg's start to the decode stream's first token.

    python -m bench.lease_guard [--requests 40]

TTFT through P/D on two shared cores varies by hundreds of milliseconds between requests, far
more than the guard can cost, so the run also times what the guard adds to a request by
itself: one pin, a ZeroMQ round trip from this process to a lease service in another process
over 127.0.0.1 (the decode engine core asks, the prefill engine core answers), 2000 times.
``lease_guard_cost_ratio`` = (unguarded TTFT p50 + pin p50) / unguarded TTFT p50.

Writes ``bench/results/lease_guard.json`` and ``lease_guard_ttft_ratio`` (guarded / not,
median TTFT, side by side) and ``lease_guard_cost_ratio`` into ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.deploy.pd_client import prefill_body
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

RESULTS = Path(__file__).parent / "results"
ARGS = ["--enforce-eager", "--max-model-len", "1024", "--block-size", "64"]


def ttft(client: httpx.Client, prefill_url: str, decode_url: str, body: dict) -> float:
    started = time.perf_counter()
    leg = prefill_body(body)
    params = client.post(f"{prefill_url}/v1/completions", json=leg).json()["kv_transfer_params"]
    decode = {**body, "stream": True, "kv_transfer_params": params}
    with client.stream("POST", f"{decode_url}/v1/completions", json=decode) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError("the decode stream ended without a token")


def engines(model: Path, logs: Path) -> dict[str, EngineProcess]:
    specs = {
        "guarded": EngineSpec(str(model), free_port(), "prefill", cpu_core=0, extra_args=ARGS),
        "unguarded": EngineSpec(
            str(model),
            free_port(),
            "prefill",
            cpu_core=0,
            extra_args=ARGS,
            kv_extra_config={"lease_guard": False},
        ),
        "decode": EngineSpec(str(model), free_port(), "decode", cpu_core=1, extra_args=ARGS),
    }
    for spec in specs.values():
        spec.side_channel_port = free_side_channel_port()
    return {name: EngineProcess(spec, logs / f"{name}.log") for name, spec in specs.items()}


SERVER = """
import sys, time
from vllm_hybrid_nixl.protocol.lease_table import LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import LeaseServer
table = LeaseTable(3600, 3600, forget_after_s=7200)
for i in range(5000):
    table.hold(f"req-{i}")
server = LeaseServer(table, "127.0.0.1")
print(server.address.port, server.address.epoch, flush=True)
time.sleep(600)
"""


def pin_round_trips(count: int = 2000) -> dict[str, float]:
    """Milliseconds per pin (p50, p99) against a lease service in another process."""
    import subprocess

    from vllm_hybrid_nixl.protocol.lease_wire import LeaseAddress, ask

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port, epoch = server.stdout.readline().split()  # type: ignore[union-attr]
        address = LeaseAddress("127.0.0.1", int(port), epoch)
        times = []
        for i in range(count):
            started = time.perf_counter()
            answer = ask(address, "pin", [f"req-{i}"])
            times.append((time.perf_counter() - started) * 1e3)
            assert answer[f"req-{i}"].readable
    finally:
        server.kill()
        server.wait()
    times.sort()
    return {"p50": times[len(times) // 2], "p99": times[int(len(times) * 0.99)]}


def run(requests: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", TinyModelSpec())
        started = engines(model, Path(tmp) / "logs")
        try:
            for engine in started.values():
                engine.start()
            for engine in started.values():
                engine.wait_healthy(timeout_s=600)
            decode = started["decode"].spec.url
            times: dict[str, list[float]] = {"guarded": [], "unguarded": []}
            with httpx.Client(timeout=120) as client:
                for i in range(requests + 4):  # the first pair of each warms up
                    prompt = f"Request {i}: the harbour master counted the boats again. " * 22
                    body = {
                        "model": str(model),
                        "prompt": prompt,
                        "max_tokens": 4,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    }
                    order = ("guarded", "unguarded") if i % 2 else ("unguarded", "guarded")
                    for name in order:
                        seconds = ttft(client, started[name].spec.url, decode, body)
                        if i >= 4:
                            times[name].append(seconds)
                        print(f"  {name} request {i}: {seconds * 1e3:.1f} ms", file=sys.stderr)
        finally:
            for engine in started.values():
                engine.stop()
    medians = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    pin = pin_round_trips()
    return {
        "requests_each": requests,
        "prompt_words": 22 * 9,
        "ttft_ms_p50": medians,
        "ttft_ms_spread": {name: [min(v) * 1e3, max(v) * 1e3] for name, v in times.items()},
        "pin_ms": pin,
        "lease_guard_ttft_ratio": medians["guarded"] / medians["unguarded"],
        "lease_guard_cost_ratio": (medians["unguarded"] + pin["p50"]) / medians["unguarded"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lease_guard.json").write_text(json.dumps(result, indent=2) + "\n")
    latest_path = args.out / "latest.json"
    latest = json.loads(latest_path.read_text()) if latest_path.exists() else {}
    latest["lease_guard_ttft_ratio"] = result["lease_guard_ttft_ratio"]
    latest["lease_guard_cost_ratio"] = result["lease_guard_cost_ratio"]
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
