"""A prefill and a decode ``vllm serve`` on 127.0.0.1, started once per test module."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.harness.releases import STOCK_REFUSAL
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec, stop_engines
from vllm_hybrid_nixl.deploy.kv_metrics import KvTransferCounters, read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer
from vllm_hybrid_nixl.router.settings import RouterSettings

COMMON_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--block-size", "64"]
WORKER_LINE = re.compile(
    r"\((?P<process>\w+) pid=(?P<prefix_pid>\d+)\).*vllm-hybrid-nixl: (?P<cls>\w+) "
    r"\(pid (?P<pid>\d+)\) validated (?P<layers>\d+) KV-cache layers \(r=(?P<r>\d+), "
    r"forms=(?P<forms>[\w,]+), groups=(?P<groups>\d+)\)"
)


@dataclass
class PdPair:
    prefill: EngineProcess
    decode: EngineProcess
    model: str


def start_pair(
    model: Path, log_dir: Path, prefill: dict, decode: dict, decode_first: bool = False
) -> Iterator[PdPair]:
    """Start both engines (own process groups), yield when healthy, stop them by PID.
    ``decode_first``: the decode engine healthy before the prefill engine starts."""
    engines = []
    for role, core, overrides in (("prefill", 0, prefill), ("decode", 1, decode)):
        spec = EngineSpec(
            model=str(model),
            port=free_port(),
            role=role,
            side_channel_port=free_side_channel_port(),
            **{"cpu_core": core, "extra_args": list(COMMON_ARGS), **overrides},
        )
        engines.append(EngineProcess(spec, log_dir / f"{role}.log"))
    try:
        waves = [[engines[1]], [engines[0]]] if decode_first else [engines]
        for wave in waves:
            for engine in wave:
                engine.start()
            for engine in wave:
                engine.wait_healthy(timeout_s=420)
        yield PdPair(engines[0], engines[1], str(model))
    finally:
        stop_engines(engines)


@dataclass
class PdVersusColocated:
    pd_choice: dict
    colocated_choice: dict
    prompt_tokens: int
    moved: KvTransferCounters  # what the decode engine's /metrics counted for this request


def run_pd_and_colocated(pair: PdPair, body: dict) -> PdVersusColocated:
    """One request disaggregated through ``pair`` and the same one colocated on its prefill
    engine, with the decode engine's KV-transfer counters for the P/D request."""
    with httpx.Client(timeout=120.0) as client:
        before = read_kv_transfer_counters(pair.decode.spec.url, client)
        try:
            result = disaggregated_completion(
                client, pair.prefill.spec.url, pair.decode.spec.url, body
            )
        except LegError as exc:  # a failed leg's HTTP 500 does not say why; the log does
            raise LegError(f"{exc}\ndecode engine's errors:\n{decode_errors(pair)}") from exc
        moved = read_kv_transfer_counters(pair.decode.spec.url, client) - before
        colocated = client.post(f"{pair.prefill.spec.url}/v1/completions", json=body).json()
    return PdVersusColocated(
        pd_choice=result.decode_response["choices"][0],
        colocated_choice=colocated["choices"][0],
        prompt_tokens=result.decode_response["usage"]["prompt_tokens"],
        moved=moved,
    )


def engine_errors(engine: EngineProcess, last: int = 20) -> str:
    """An engine's last ERROR lines from its log."""
    lines = [line for line in engine.log_text().splitlines() if " ERROR " in line]
    return "\n".join(lines[-last:])


def decode_errors(pair: PdPair) -> str:
    """The decode engine's last ERROR lines from its log."""
    return engine_errors(pair.decode)


def engine_posts(url: str) -> float:
    """POSTs to the OpenAI routes the engine counted (any status), from its /metrics."""
    text = read_metrics(url)
    return sum(
        sample_sum(text, "http_requests_total", method="POST", handler=route)
        for route in ("/v1/completions", "/v1/chat/completions")
    )


def metric_sum(url: str, sample: str, **labels: str) -> float:
    """The sum of ``url``'s /metrics samples named ``sample`` whose labels include ``labels``
    (0 when there is none yet)."""
    return sample_sum(read_metrics(url), sample, **labels)


@contextmanager
def compute_paused(*engine_pids: int) -> Iterator[None]:
    """Stop (SIGSTOP) every process below each engine's API server — its engine core and
    workers — and continue them on exit: the API servers still take requests and
    disconnects, but no request can make progress, whatever the machine's speed."""
    below = [p for pid in engine_pids for p in psutil.Process(pid).children(recursive=True)]
    for process in below:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in below:
            with suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGCONT)


def request_reruns(router_url: str) -> float:
    """Whole requests the router ran again (``router_retries_total{leg="request"}``)."""
    return metric_sum(router_url, "router_retries_total", leg="request")


def colocated_texts(
    engine_url: str, bodies: list[dict], headers: dict[str, str]
) -> dict[tuple[str, int], str]:
    """Each distinct (prompt, max_tokens) of ``bodies`` answered by one engine alone."""
    expected: dict[tuple[str, int], str] = {}
    with httpx.Client(timeout=300.0, headers=headers) as client:
        for body in bodies:
            key = (body["prompt"], body["max_tokens"])
            if key not in expected:
                plain = {**body, "stream": False}
                answer = client.post(f"{engine_url}/v1/completions", json=plain)
                expected[key] = answer.json()["choices"][0]["text"]
    return expected


def stock_engine_spec(model: Path, env: dict[str, str] | None = None) -> EngineSpec:
    """One engine with vLLM's stock NixlConnector, on the second core."""
    return EngineSpec(
        model=str(model),
        port=free_port(),
        role="prefill",
        side_channel_port=free_side_channel_port(),
        cpu_core=1,
        connector="NixlConnector",
        env=dict(env or {}),
        extra_args=list(COMMON_ARGS),
    )


def assert_stock_refuses_at_start_up(model: Path, log: Path, env: dict[str, str]) -> None:
    """vLLM 0.24-0.25: the stock connector's engine dies in registration (its strict
    block-count check cannot take vLLM's CPU cache). vLLM's API server may linger, so the
    log (and the process) is watched rather than an exit awaited."""
    spec = stock_engine_spec(model, env)
    engine = EngineProcess(spec, log).start()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if STOCK_REFUSAL in engine.log_text() or not engine.alive():
                break
            time.sleep(2)
        assert STOCK_REFUSAL in engine.log_text()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{spec.url}/health", timeout=5).raise_for_status()
    finally:
        engine.stop()


def wait_router_ready(url: str, timeout_s: float = 120, layouts: bool = False) -> None:
    """Until the router's probes have seen every engine healthy (and, with ``layouts``, read
    every engine's layout): its start-up probe round may have missed an engine busy on a
    shared core; the next round, seconds later, finds it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=30).json()
        engines = health.get("engines", [])
        known = not layouts or not any(
            str(e.get("layout", "unknown")).startswith("unknown") for e in engines
        )
        if engines and all(e.get("up") for e in engines) and known:
            return
        time.sleep(0.5)
    raise AssertionError(f"router engines not up: {health}")


@contextmanager
def running_router(
    pool: BackendPool, layouts: bool = False, settings: RouterSettings | None = None
) -> Iterator[str]:
    """Our router in this process on a free 127.0.0.1 port in front of ``pool``, ready
    (:func:`wait_router_ready`); its URL. Stopped on exit."""
    router = RouterServer(pool, "127.0.0.1", free_port(), settings=settings).start()
    try:
        wait_router_ready(router.url, layouts=layouts)
        yield router.url
    finally:
        router.stop()
