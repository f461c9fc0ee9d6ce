"""What a silent lease service costs the decode engine's other streams: inter-token latency
of a running stream while decode legs wait on a prefill whose lease port never answers,
against the same stream while the same legs meet a lease service that answers at once, side
by side in one run (rounds alternate).

One prefill and one decode engine (tiny model, HybridNixlConnector, one core each; the
decode's ``lease_check_timeout`` 1 s, 3 tries). Each round streams one colocated request of 384
tokens from the decode engine (one token per event) and reads the gaps between events. At
its first token, four decode legs arrive whose ``hybrid_lease`` names a stand-in lease
service: in *answering* rounds it refuses each pin at once ("released"), in *blackhole*
rounds it takes the question and never answers, so the pins wait (3 s) and then fail. Both
arms send the same legs, which fail either way; the only difference is the silence.
``lease_blackhole_itl_ratio`` = ITL p99 blackhole / answering.

    python -m bench.lease_blackhole [--rounds 10]

Writes ``bench/results/lease_blackhole.json`` and ``lease_blackhole_itl_ratio`` into
``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import zmq

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.deploy.pd_client import prefill_body
from vllm_hybrid_nixl.protocol.lease_wire import PARAMS_KEY
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

RESULTS = Path(__file__).parent / "results"
ARGS = ["--enforce-eager", "--max-model-len", "1024", "--block-size", "64"]
STREAM_TOKENS = 384
REFUSED_LEGS = 4


class LeaseStandIn:
    """A lease service on 127.0.0.1 that refuses every pin at once ("released"), or, as a
    blackhole, takes every question and never answers."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)  # any number of askers
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                identity, empty, raw = self.socket.recv_multipart()
                if not self.answers:
                    continue
                asked = json.loads(raw)
                released = {"state": "released", "reason": "bench: refused at once"}
                reply = {"epoch": asked["epoch"], "leases": {r: released for r in asked["reqs"]}}
                self.socket.send_multipart([identity, empty, json.dumps(reply).encode()])
            except zmq.ZMQError:
                return


def stream_gaps(
    client: httpx.Client, url: str, body: dict, at_first: threading.Event
) -> list[float]:
    """Seconds between the stream's token events (after the first)."""
    gaps, last = [], None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is None:
                at_first.set()
            else:
                gaps.append(now - last)
            last = now
    return gaps


def refused_legs(prefill: str, decode: str, body: dict, hole: LeaseStandIn) -> list[int]:
    """Decode legs whose lease service is ``hole``; their HTTP statuses."""
    statuses: list[int] = []
    with httpx.Client(timeout=120) as client:
        legs = []
        for _ in range(REFUSED_LEGS):
            params = client.post(f"{prefill}/v1/completions", json=prefill_body(body)).json()[
                "kv_transfer_params"
            ]
            params[PARAMS_KEY] = {**params[PARAMS_KEY], "port": hole.port}
            legs.append({**body, "kv_transfer_params": params})

    def send(leg: dict) -> None:
        statuses.append(httpx.post(f"{decode}/v1/completions", json=leg, timeout=120).status_code)

    threads = [threading.Thread(target=send, args=(leg,)) for leg in legs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


statuses: dict[str, list[int]] = {"answering": [], "blackhole": []}


def after_first_token(
    first: threading.Event, prefill: str, decode: str, leg: dict, hole: LeaseStandIn
) -> None:
    first.wait(60)
    kind = "answering" if hole.answers else "blackhole"
    statuses[kind].extend(refused_legs(prefill, decode, leg, hole))


def run(rounds: int) -> dict:
    gaps: dict[str, list[float]] = {"answering": [], "blackhole": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", TinyModelSpec())
        specs = {
            "prefill": EngineSpec(str(model), free_port(), "prefill", cpu_core=0, extra_args=ARGS),
            "decode": EngineSpec(
                str(model),
                free_port(),
                "decode",
                cpu_core=1,
                extra_args=ARGS,
                kv_extra_config={"lease_check_timeout": 1},
            ),
        }
        for spec in specs.values():
            spec.side_channel_port = free_port()
        engines = {n: EngineProcess(s, Path(tmp) / f"{n}.log") for n, s in specs.items()}
        holes = {"answering": LeaseStandIn(answers=True), "blackhole": LeaseStandIn(answers=False)}
        try:
            for engine in engines.values():
                engine.start()
            for engine in engines.values():
                engine.wait_healthy(timeout_s=600)
            prefill, decode = specs["prefill"].url, specs["decode"].url
            stream = {
                "model": str(model),
                "prompt": "The keeper wrote the weather in the log every hour. " * 4,
                "max_tokens": STREAM_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            leg = {**stream, "prompt": "A ship waits outside the harbour. " * 8, "max_tokens": 4}
            with httpx.Client(timeout=300) as client:
                for kind in holes:  # warm-up, the NIXL handshake of the first leg included
                    first = threading.Event()
                    helper = threading.Thread(
                        target=after_first_token, args=(first, prefill, decode, leg, holes[kind])
                    )
                    helper.start()
                    stream_gaps(client, decode, stream, first)
                    helper.join()
                for values in statuses.values():
                    values.clear()
                for i in range(2 * rounds):
                    kind = ("answering", "blackhole")[(i + i // 2) % 2]  # a b, b a, a b, ...
                    first = threading.Event()
                    helper = threading.Thread(
                        target=after_first_token, args=(first, prefill, decode, leg, holes[kind])
                    )
                    helper.start()
                    measured = stream_gaps(client, decode, stream, first)
                    helper.join()
                    gaps[kind].extend(measured)
                    p99 = np.percentile(measured, 99) * 1e3
                    print(f"  round {i // 2} {kind}: ITL p99 {p99:.1f} ms", file=sys.stderr)
        finally:
            for engine in engines.values():
                engine.stop()
    p99 = {k: float(np.percentile(v, 99)) * 1e3 for k, v in gaps.items()}
    p50 = {k: float(np.percentile(v, 50)) * 1e3 for k, v in gaps.items()}
    return {
        "rounds_each": rounds,
        "stream_tokens": STREAM_TOKENS,
        "refused_legs_per_round": REFUSED_LEGS,
        "refused_leg_statuses": {k: sorted(set(v)) for k, v in statuses.items()},
        "itl_ms_p50": p50,
        "itl_ms_p99": p99,
        "itl_ms_max": {k: max(v) * 1e3 for k, v in gaps.items()},
        "lease_blackhole_itl_ratio": p99["blackhole"] / p99["answering"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lease_blackhole.json").write_text(json.dumps(result, indent=2) + "\n")
    latest_path = args.out / "latest.json"
    latest = json.loads(latest_path.read_text()) if latest_path.exists() else {}
    latest["lease_blackhole_itl_ratio"] = result["lease_blackhole_itl_ratio"]
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
