"""Keys and limits across the whole stack: real keyed ``vllm serve`` engines (prefill and
decode, NIXL between them), the router started as users start it (the CLI, keys in its
environment), clients on 127.0.0.1."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.pd_fixture import (
    COMMON_ARGS,
    PdPair,
    colocated_texts,
    compute_paused,
    engine_posts,
    metric_sum,
    request_reruns,
    start_pair,
)
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum
from vllm_hybrid_nixl.router.auth import EngineAccessError
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer
from vllm_hybrid_nixl.router.settings import RouterKeys

pytestmark = pytest.mark.e2e

ENGINE_KEY = "sk-engine-7f3a9c1e5b"
ROUTER_KEY = "sk-router-2d8e4b6a0c"
SCRIPT = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))
PROMPT = " ".join(["the router checks keys before any engine sees a request"] * 4)


@dataclass
class Stack:
    pair: PdPair
    router_url: str
    router_log: Path
    router_pid: int
    model: str


@pytest.fixture(scope="module")
def stack(tiny_hybrid_model, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("security-logs")
    keyed = {"env": {"VLLM_API_KEY": ENGINE_KEY}}
    logged = {**keyed, "extra_args": [*COMMON_ARGS, "--enable-log-requests"]}
    for pair in start_pair(tiny_hybrid_model, logs, dict(keyed), logged):
        port = free_port()
        router_log = logs / "router.log"
        env = {
            **os.environ,
            "VLLM_HYBRID_NIXL_API_KEY": ROUTER_KEY,
            "VLLM_HYBRID_NIXL_ENGINE_API_KEY": ENGINE_KEY,
        }
        with open(router_log, "wb") as log:
            router = subprocess.Popen(
                [
                    SCRIPT,
                    "router",
                    "--port",
                    str(port),
                    "--prefill",
                    pair.prefill.spec.url,
                    "--decode",
                    pair.decode.spec.url,
                    "--prefill-side-channel",
                    pair.prefill.spec.side_channel,
                    "--decode-side-channel",
                    pair.decode.spec.side_channel,
                    "--max-prompt-chars",
                    "2000",
                    "--max-body-bytes",
                    "65536",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert router.poll() is None, router_log.read_text()
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                pytest.fail("router did not become healthy:\n" + router_log.read_text())
            yield Stack(pair, url, router_log, router.pid, str(tiny_hybrid_model))
        finally:
            router.terminate()
            try:
                router.wait(timeout=20)
            except subprocess.TimeoutExpired:
                router.kill()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_engines_refuse_requests_without_their_key(stack: Stack) -> None:
    """The premise: the engines really are keyed."""
    body = {"model": stack.model, "prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{stack.pair.prefill.spec.url}/v1/completions", json=body).status_code == 401


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), bearer(ENGINE_KEY)])
def test_router_answers_401_without_its_key(stack: Stack, headers) -> None:
    before = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 4}
    response = httpx.post(f"{stack.router_url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == 401
    assert [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)] == before


def test_router_serves_with_its_key_and_uses_the_engine_key(stack: Stack) -> None:
    moved_before = read_kv_transfer_counters(stack.pair.decode.spec.url)
    posts_before = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    response = httpx.post(
        f"{stack.router_url}/v1/completions", json=body, headers=bearer(ROUTER_KEY), timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    moved = read_kv_transfer_counters(stack.pair.decode.spec.url) - moved_before
    assert moved.nixl_bytes > 0  # the decode engine read the prompt's KV over NIXL
    posts = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    # one leg each: the counter the "no engine contacted" tests rely on does count
    assert [a - b for a, b in zip(posts, posts_before, strict=True)] == [1.0, 1.0]
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(
        f"{stack.router_url}/v1/chat/completions",
        json=chat,
        headers=bearer(ROUTER_KEY),
        timeout=120,
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"prompt": "p" * 70000, "max_tokens": 1}, 413, "at most 65536"),
        ({"prompt": "p" * 2001, "max_tokens": 1}, 413, "2001 characters"),
        ({"prompt": "p", "n": 17}, 400, "max_n"),
        ({"prompt": "p", "max_tokens": 0}, 400, "at least 1"),
        ({"prompt": "p", "max_tokens": 5000}, 400, "context length"),  # max-model-len 1024
        ({"prompt": "p", "model": "gpt-unknown"}, 404, "is not served here"),
        ({"prompt": "p", "kv_transfer_params": {"do_remote_prefill": True}}, 400, "router"),
    ],
)
def test_limits_are_enforced_before_any_engine_is_contacted(
    stack: Stack, body: dict, status: int, words: str
) -> None:
    body = {"model": stack.model, **body}
    before = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    response = httpx.post(
        f"{stack.router_url}/v1/completions", json=body, headers=bearer(ROUTER_KEY), timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["code"] == status
    assert [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)] == before


def test_min_tokens_passes_through_p_d(stack: Stack) -> None:
    """A valid vLLM sampling parameter: clamped on the prefill leg (max_tokens 1), kept on
    the decode leg."""
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 6, "min_tokens": 5}
    response = httpx.post(
        f"{stack.router_url}/v1/completions", json=body, headers=bearer(ROUTER_KEY), timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 5


@pytest.mark.parametrize(
    ("extra", "param_word"),
    [
        ({"temperature": -3.0}, "temperature"),
        ({"prompt": [[999999999]]}, "token"),
        ({"stop": 12}, ""),
        ({"logprobs": 10**6}, "logprobs"),
    ],
)
def test_engine_judged_errors_reach_the_client_without_addresses(
    stack: Stack, extra: dict, param_word: str
) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 4, **extra}
    response = httpx.post(
        f"{stack.router_url}/v1/completions", json=body, headers=bearer(ROUTER_KEY), timeout=120
    )
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["request_id"] and error["type"] != "upstream_error"
    assert param_word.lower() in json.dumps(error).lower()
    for engine in (stack.pair.prefill, stack.pair.decode):
        assert str(engine.spec.port) not in response.text and "127.0.0" not in response.text
    assert error["request_id"] in stack.router_log.read_text()  # the log has the details


def test_a_body_nested_5000_levels_deep_gets_a_json_400(stack: Stack) -> None:
    before = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    nested = "[" * 5000 + "]" * 5000
    raw = f'{{"model": "{stack.model}", "prompt": "p", "extra": {nested}}}'
    response = httpx.post(
        f"{stack.router_url}/v1/completions",
        content=raw,
        headers={**bearer(ROUTER_KEY), "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400
    assert "nests JSON deeper" in response.json()["error"]["message"]
    assert [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)] == before


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither; httpx refuses both
    st.text(max_size=40),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = {
    "prompt": st.one_of(
        st.text(max_size=60), st.lists(st.integers(-5, 5000), max_size=8), JSON_VALUES
    ),
    "max_tokens": st.one_of(st.integers(-3, 4), st.integers(2**31, 2**70), JSON_SCALARS),
    "min_tokens": st.one_of(st.integers(-2, 6), JSON_SCALARS),
    "temperature": st.one_of(st.floats(-2, 3, allow_nan=False), JSON_SCALARS),
    "n": st.one_of(st.integers(-1, 3), JSON_SCALARS),
    "stream": JSON_SCALARS,
    "stop": JSON_VALUES,
    "logprobs": st.one_of(st.integers(-1, 30), JSON_SCALARS),
    "messages": JSON_VALUES,
    "kv_transfer_params": JSON_VALUES,
    "extra": JSON_VALUES,
}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fields=st.fixed_dictionaries({}, optional=FIELDS),
    with_model=st.booleans(),
    endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_generated_bodies_never_get_a_router_5xx(
    stack: Stack, fields: dict, with_model: bool, endpoint: str
) -> None:
    """Property: whatever the body, the router itself answers it (200, or an OpenAI-style
    4xx/502 naming a leg), never 500; a body the router rejects touches no engine."""
    body = {"model": stack.model, **fields} if with_model else fields
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"]:
        body["max_tokens"] = min(body["max_tokens"], 4)
    before = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
    response = httpx.post(
        f"{stack.router_url}{endpoint}", json=body, headers=bearer(ROUTER_KEY), timeout=120
    )
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        return
    error = response.json()["error"]  # always JSON, OpenAI-style
    assert error["code"] == response.status_code
    if "leg" not in error:  # the router's own judgement: no engine saw the request
        after = [engine_posts(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)]
        assert after == before, (body, response.text)


def test_a_router_with_the_wrong_engine_key_stops_at_start_up(stack: Stack) -> None:
    pool = BackendPool.from_urls([stack.pair.prefill.spec.url], [stack.pair.decode.spec.url])
    for keys, words in (
        (RouterKeys(engine_api_key="sk-not-it"), "the router's engine key was refused"),
        (RouterKeys(), "they require an API key and the router has none"),
    ):
        router = RouterServer(pool, keys=keys)
        with pytest.raises(EngineAccessError, match=words) as caught:
            router.start()
        assert "VLLM_HYBRID_NIXL_ENGINE_API_KEY" in str(caught.value)
        assert "sk-not-it" not in str(caught.value)
        router.stop()


def test_64_concurrent_requests_through_1p1d_all_correct_and_router_returns_to_baseline(
    stack: Stack,
) -> None:
    """Load on the keyed 1P1D stack (the 2P2D load runs in test_ray_pd)."""
    import asyncio

    router = psutil.Process(stack.router_pid)
    prompts = [
        f"load {i}: " + " ".join(["tokens for the kv cache"] * (1 + i % 7)) for i in range(16)
    ]
    bodies = [
        {
            "model": stack.model,
            "prompt": p,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        for p in prompts
        for stream in (False, True)
        for n in (6, 10)
    ]
    expected = colocated_texts(stack.pair.prefill.spec.url, bodies, bearer(ENGINE_KEY))

    def baseline() -> tuple[int, int]:
        time.sleep(3.0)  # pooled connections expire after 2 s idle; the next request prunes
        httpx.get(f"{stack.router_url}/v1/models", headers=bearer(ROUTER_KEY), timeout=30)
        connections = len(router.net_connections(kind="tcp"))
        return router.memory_info().rss, connections

    rss_before, connections_before = baseline()
    posts_before = engine_posts(stack.pair.decode.spec.url)
    reruns_before = request_reruns(stack.router_url)

    async def one(client: httpx.AsyncClient, body: dict) -> str:
        url = f"{stack.router_url}/v1/completions"
        if not body["stream"]:
            response = await client.post(url, json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]
        text = []
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text.append(event["choices"][0]["text"])
        return "".join(text)

    async def fire() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            timeout=600, limits=limits, headers=bearer(ROUTER_KEY)
        ) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))

    texts = asyncio.run(fire())
    assert len(texts) == 64
    wrong = [
        (b["prompt"][:10], b["stream"])
        for b, t in zip(bodies, texts, strict=True)
        if t != expected[(b["prompt"], b["max_tokens"])]
    ]
    assert wrong == []
    # once each, plus whole-request re-runs after a broken decode link (if it arrived at all)
    posts = engine_posts(stack.pair.decode.spec.url) - posts_before
    assert 64 <= posts <= 64 + request_reruns(stack.router_url) - reruns_before
    rss_after, connections_after = baseline()
    assert connections_after <= connections_before + 2
    assert rss_after - rss_before < 48 * 2**20, (rss_before, rss_after)


def engine_load(url: str) -> tuple[float, float]:
    """(requests running or waiting, KV-cache usage) from an engine's /metrics."""
    text = read_metrics(url)
    running = sample_sum(text, "vllm:num_requests_running")
    waiting = sample_sum(text, "vllm:num_requests_waiting")
    return running + waiting, sample_sum(text, "vllm:kv_cache_usage_perc")


def wait_engines_idle(stack: Stack, timeout_s: float = 60.0) -> dict[str, tuple]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {
            e.spec.role: engine_load(e.spec.url) for e in (stack.pair.prefill, stack.pair.decode)
        }
        if all(load == (0.0, 0.0) for load in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


def answer_so_far(connection: socket.socket) -> bytes:
    """What the router has sent on ``connection`` so far, without consuming or waiting."""
    readable, _, _ = select.select([connection], [], [], 0)
    return connection.recv(4096, socket.MSG_PEEK) if readable else b""


def received_requests(engine: EngineProcess) -> int:
    """Requests the engine's API server logged on arrival (it runs with --enable-log-requests)."""
    return engine.log_text().count("Received request")


def finished_by_length(url: str) -> float:
    """Requests the engine ran to ``max_tokens`` (``vllm:request_success_total``, length)."""
    return metric_sum(url, "vllm:request_success_total", finished_reason="length")


def router_disconnects(stack: Stack) -> float:
    """``router_client_disconnects_total`` from the router's /metrics."""
    return metric_sum(stack.router_url, "router_client_disconnects_total")


def leave_while_decode_holds_it(stack: Stack, url: str, body: dict) -> None:
    """Send a whole (not streamed) request and hang up once the decode engine's API server
    holds its decode leg. The decode engine's core is paused meanwhile, so the leg cannot
    finish before the client leaves, however fast the engines are."""
    target = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
        f"Authorization: Bearer {ROUTER_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    decode = stack.pair.decode
    before = received_requests(decode)
    with compute_paused(decode.pid):
        with socket.create_connection((target.host, target.port), timeout=30) as connection:
            connection.sendall(head.encode() + payload)
            deadline = time.monotonic() + 120
            while received_requests(decode) == before:
                early = answer_so_far(connection)
                assert not early, f"the router answered before the decode leg arrived: {early!r}"
                assert time.monotonic() < deadline, "no decode leg arrived:\n" + logs_tail(stack)
                time.sleep(0.05)
            assert answer_so_far(connection) == b"", "the router answered a paused decode leg"
            seen = router_disconnects(stack)
        leaving = time.monotonic() + 60  # the router sees the client leave before the core runs
        while router_disconnects(stack) < seen + 1:
            assert time.monotonic() < leaving, "the router never saw the client leave"
            time.sleep(0.05)


def logs_tail(stack: Stack, lines: int = 30) -> str:
    """The last lines of the router's and both engines' logs, for a failure message."""
    router = stack.router_log.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(
        [
            "--- router ---",
            *router,
            "--- prefill ---",
            stack.pair.prefill.log_tail(lines),
            "--- decode ---",
            stack.pair.decode.log_tail(lines),
        ]
    )


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_aborts_both_legs(stack: Stack, stream: bool) -> None:
    """Engines keep no request and no KV blocks for a client that went away: one that leaves
    a stream after its first token (the decode leg running), one that leaves a whole request
    while the decode engine holds its leg (the prefill's blocks still lent to it)."""
    before = router_disconnects(stack)
    assert wait_engines_idle(stack) == {"prefill": (0.0, 0.0), "decode": (0.0, 0.0)}
    decode_url = stack.pair.decode.spec.url
    ran_out_before = finished_by_length(decode_url)
    body = {
        "model": stack.model,
        "prompt": PROMPT,
        "max_tokens": 900,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    url = f"{stack.router_url}/v1/completions"
    if stream:
        with httpx.Client(timeout=60, headers=bearer(ROUTER_KEY)) as client:
            with client.stream("POST", url, json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")  # the decode leg is running
    else:
        leave_while_decode_holds_it(stack, url, body)
    assert wait_engines_idle(stack) == {"prefill": (0.0, 0.0), "decode": (0.0, 0.0)}
    deadline = time.monotonic() + 10
    while router_disconnects(stack) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert router_disconnects(stack) == before + 1
    assert finished_by_length(decode_url) == ran_out_before, "the decode leg ran to the end"


def test_keys_appear_in_no_log_health_or_process_listing(stack: Stack) -> None:
    """Runs last in the module: everything above has been logged by then."""
    health = httpx.get(f"{stack.router_url}/health", timeout=30)
    assert health.status_code == 200
    texts = {
        "router /health": health.text,
        "router /metrics": httpx.get(f"{stack.router_url}/metrics").text,
        "router log": stack.router_log.read_text(errors="replace"),
        "prefill log": stack.pair.prefill.log_text(),
        "decode log": stack.pair.decode.log_text(),
    }
    for pid in (stack.router_pid, stack.pair.prefill.pid, stack.pair.decode.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        texts[f"argv of pid {pid}"] = cmdline.decode(errors="replace")
    assert len(texts["prefill log"]) > 1000  # the logs are real, not empty
    for where, text in texts.items():
        for key in (ENGINE_KEY, ROUTER_KEY):
            assert key not in text, f"{key[:6]}... found in {where}"
