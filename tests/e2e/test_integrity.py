"""Never silently wrong for ordinary and careless input: batches, n > 1, duplicated readers,
malformed lease messages and lease values, and a busy decode engine.

Real ``vllm serve`` engines with HybridNixlConnector on a tiny sliding-window hybrid (block
64), our router in front. The prefill engine's lease is 2 s and the decode engine runs one
request at a time, so a decode request that queues behind another outlives the lease unless
its engine renews it. Every test asserts zero HTTP 200 with wrong tokens and both engines
alive afterwards. The stock connector's answers to the same batch (wrong tokens) are shown by
the stock controls in ``test_layout_guard``, so these tests can fail.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq

from bench.kv_timeline import requests_in, stage_times, summarize
from tests.e2e.pd_fixture import (
    COMMON_ARGS,
    PdPair,
    metric_sum,
    running_router,
    start_pair,
)
from tests.unit.test_digest_wire import raw_ask
from vllm_hybrid_nixl.common.netutil import DIGEST_PORT_OFFSET, LEASE_PORT_OFFSET
from vllm_hybrid_nixl.connector.kv_timeline import ENV as KV_TIMELINE_ENV
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.pd_client import disaggregated_completion, prefill_body
from vllm_hybrid_nixl.protocol.digest_wire import endpoint_of
from vllm_hybrid_nixl.protocol.lease_wire import PARAMS_KEY, LeaseAddress
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.e2e

LEASE_S = 2
PIN_TIMEOUT_S = 8  # the decode engine's lease_check_timeout (a pin tries 3 times)
A = "The harbour master counted ships at dawn and wrote each name in the ledger. " * 3
B = "A gull circled the old lighthouse while the keeper mended nets by the door. " * 3
# Two blocks (128 tokens) longer than A: the decode engine died on it with A's parameters.
LONGER = B + "Rain fell on the slate roofs of the fishing village all through the night. " * 12
BINDING_REFUSAL = "prefilled another prompt"


@dataclass
class Stack:
    pair: PdPair
    router_url: str
    timeline: Path  # where the decode engine records each request's KV path


@pytest.fixture(scope="module")
def stack(tiny_hybrid_model: Path, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("integrity-logs")
    timeline = logs / "kv-timeline.jsonl"
    pairs = start_pair(
        tiny_hybrid_model,
        logs,
        prefill={"kv_extra_config": {"kv_lease_duration": LEASE_S}},
        decode={
            "extra_args": [*COMMON_ARGS, "--max-num-seqs", "1"],
            "kv_extra_config": {"lease_check_timeout": PIN_TIMEOUT_S},
            "env": {KV_TIMELINE_ENV: str(timeline)},
        },
    )
    pair = next(pairs)
    pool = BackendPool.from_urls([pair.prefill.spec.url], [pair.decode.spec.url])
    try:
        with running_router(pool) as router_url:
            yield Stack(pair, router_url, timeline)
    finally:
        pairs.close()


def body(model: str, prompt: object, max_tokens: int = 10, **extra: object) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


_expected: dict[tuple[str, int], str] = {}


def alone(stack: Stack, prompt: str, max_tokens: int = 10) -> str:
    """``prompt`` answered by the prefill engine alone (colocated, greedy)."""
    key = (prompt, max_tokens)
    if key not in _expected:
        answer = httpx.post(
            f"{stack.pair.prefill.spec.url}/v1/completions",
            json=body(stack.pair.model, prompt, max_tokens),
            timeout=300,
        )
        answer.raise_for_status()
        _expected[key] = answer.json()["choices"][0]["text"]
    return _expected[key]


def assert_alive(stack: Stack) -> None:
    for engine in (stack.pair.prefill, stack.pair.decode):
        assert engine.alive(), f"{engine.spec.role} engine died"
        httpx.get(f"{engine.spec.url}/health", timeout=30).raise_for_status()


def streamed_texts(response: httpx.Response) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[6:])
        assert "error" not in payload, payload
        for choice in payload.get("choices", []):
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prompt_list_through_the_router_is_answered_prompt_by_prompt(
    stack: Stack, stream: bool
) -> None:
    prompts = [A, B, LONGER]
    expected = [alone(stack, p) for p in prompts]
    with httpx.Client(timeout=300) as client:
        request = body(stack.pair.model, prompts, stream=stream)
        if stream:
            with client.stream("POST", f"{stack.router_url}/v1/completions", json=request) as r:
                assert r.status_code == 200
                texts = streamed_texts(r)
        else:
            answer = client.post(f"{stack.router_url}/v1/completions", json=request)
            assert answer.status_code == 200, answer.text
            texts = {c["index"]: c["text"] for c in answer.json()["choices"]}
            usage = answer.json()["usage"]
            assert usage["completion_tokens"] == 30
        assert texts == dict(enumerate(expected))
        # Nothing poisoned the decode engine's prefix cache: B alone is still B's answer.
        again = client.post(f"{stack.router_url}/v1/completions", json=body(stack.pair.model, B))
        assert again.json()["choices"][0]["text"] == expected[1]
    assert_alive(stack)


def test_token_id_lists_and_n_through_the_router(stack: Stack) -> None:
    with httpx.Client(timeout=300) as client:
        tokens = client.post(
            f"{stack.pair.prefill.spec.url}/tokenize", json={"prompt": B, "model": stack.pair.model}
        ).json()["tokens"]
        # n > 1 samples (vLLM refuses it greedy); seeded, so both sides draw the same.
        request = body(stack.pair.model, [tokens[:40], tokens], n=2, temperature=1.0, seed=7)
        answer = client.post(f"{stack.router_url}/v1/completions", json=request)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        colocated = client.post(f"{stack.pair.prefill.spec.url}/v1/completions", json=request)
        colocated.raise_for_status()
        greedy = client.post(
            f"{stack.router_url}/v1/completions", json={**request, "temperature": 0.0}
        )
    assert greedy.status_code == 400 and "greedy" in greedy.text
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [c["text"] for c in colocated.json()["choices"]]
    assert_alive(stack)


def test_chat_n_through_the_router(stack: Stack) -> None:
    chat = {
        "model": stack.pair.model,
        "messages": [{"role": "user", "content": A}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
    }
    with httpx.Client(timeout=300) as client:
        answer = client.post(f"{stack.router_url}/v1/chat/completions", json=chat)
        colocated = client.post(f"{stack.pair.prefill.spec.url}/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert colocated.status_code == 200, colocated.text
    got = [(c["index"], c["message"]["content"]) for c in answer.json()["choices"]]
    want = [(c["index"], c["message"]["content"]) for c in colocated.json()["choices"]]
    assert got == want


@pytest.mark.parametrize("second", [B, LONGER], ids=["same-length", "two-blocks-longer"])
def test_a_batch_sent_to_the_engines_with_one_prefills_params_is_answered_right(
    stack: Stack, second: str
) -> None:
    """No router: vLLM's completions endpoint returns the first prompt's parameters for a
    batch, and a client hands them to the decode engine with the whole batch. The decode
    engine reads A's KV for A only; the other prompt is computed on the decode engine."""
    pair = stack.pair
    expected = [alone(stack, A), alone(stack, second)]
    before = pair.decode.log_text().count(BINDING_REFUSAL)
    with httpx.Client(timeout=300) as client:
        prefill = client.post(
            f"{pair.prefill.spec.url}/v1/completions",
            json=prefill_body(body(pair.model, [A, second])),
        )
        params = prefill.json()["kv_transfer_params"]
        decode = client.post(
            f"{pair.decode.spec.url}/v1/completions",
            json={**body(pair.model, [A, second]), "kv_transfer_params": params},
        )
        assert decode.status_code == 200, decode.text
        texts = [c["text"] for c in sorted(decode.json()["choices"], key=lambda c: c["index"])]
        assert texts == expected
        # And the second prompt alone, disaggregated, still gets its own answer.
        result = disaggregated_completion(
            client, pair.prefill.spec.url, pair.decode.spec.url, body(pair.model, second)
        )
        assert result.text == expected[1]
    assert pair.decode.log_text().count(BINDING_REFUSAL) > before
    assert_alive(stack)


def test_two_decode_requests_reading_one_prefill_never_answer_wrong(stack: Stack) -> None:
    """A duplicated decode leg (same parameters, sent twice at once): one reads the blocks;
    the other computes its prompt itself or fails loudly. Never a 200 with other tokens."""
    pair = stack.pair
    expected = alone(stack, A)
    with httpx.Client(timeout=300) as client:
        prefill = client.post(
            f"{pair.prefill.spec.url}/v1/completions", json=prefill_body(body(pair.model, A))
        )
        params = prefill.json()["kv_transfer_params"]
        answers: list[httpx.Response] = []

        def leg() -> None:
            answers.append(
                httpx.post(
                    f"{pair.decode.spec.url}/v1/completions",
                    json={**body(pair.model, A), "kv_transfer_params": params},
                    timeout=300,
                )
            )

        threads = [threading.Thread(target=leg) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    ok = [a for a in answers if a.status_code == 200]
    assert ok, [a.text[:300] for a in answers]
    assert all(a.json()["choices"][0]["text"] == expected for a in ok)
    assert_alive(stack)


def lease_address(stack: Stack) -> LeaseAddress:
    prefill = httpx.post(
        f"{stack.pair.prefill.spec.url}/v1/completions",
        json=prefill_body(body(stack.pair.model, A)),
        timeout=300,
    )
    address = LeaseAddress.from_params(prefill.json()["kv_transfer_params"][PARAMS_KEY])
    assert address is not None
    return address


def random_message(rng: random.Random, epoch: str) -> bytes:
    shapes = [
        lambda: b"[" * rng.randrange(1, 60_000),
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
        lambda: json.dumps(rng.choice([None, 1, "pin", [], {}])).encode(),
        lambda: json.dumps(
            {
                "op": rng.choice(["pin", "renew", "status", "x"]),
                "epoch": epoch,
                "reqs": rng.choice([[], "r", [1], [["r"]], ["r"] * 300]),
            }
        ).encode(),
        lambda: json.dumps(
            {
                "op": "pin",
                "epoch": epoch,
                "reqs": [f"cmpl-{rng.random()}"],
                "readers": rng.choice([[], {"a": 1}, "x"]),
            }
        ).encode(),
    ]
    return rng.choice(shapes)()


def test_the_lease_service_answers_malformed_messages_and_keeps_serving(stack: Stack) -> None:
    address = lease_address(stack)
    # No lease_port set: the documented default, the side-channel port + 1000.
    assert address.port == stack.pair.prefill.spec.side_channel_port + LEASE_PORT_OFFSET
    rng = random.Random(2026)
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address.endpoint)
    errors = 0
    try:
        for _ in range(300):
            socket.send(random_message(rng, address.epoch))
            assert socket.poll(30_000), "the lease service stopped answering"
            errors += "error" in json.loads(socket.recv())
    finally:
        socket.close()
    assert errors >= 250  # nearly every message above is malformed
    with httpx.Client(timeout=300) as client:
        answer = client.post(f"{stack.router_url}/v1/completions", json=body(stack.pair.model, B))
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone(stack, B)
    assert_alive(stack)


class Impostor:
    """A ZeroMQ REP server on 127.0.0.1 answering every question with non-protocol bytes."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        replies = [b"not json", b"[]", b'{"epoch": 1}', b"[" * 50_000]
        i = 0
        while True:
            try:
                self.socket.recv()
                self.socket.send(replies[i % len(replies)])
                i += 1
            except zmq.ZMQError:
                return


def test_the_digest_service_answers_hostile_questions_and_serves_on(stack: Stack) -> None:
    """Malformed and hostile KV digest questions (``split`` of every wrong shape, random
    bytes) sent to the prefill worker's real digest service: each malformed split gets an
    error naming it, a well-formed one for an unknown request says so, and afterwards both
    engines are up and a P/D request through the router is answered as colocated."""
    pair = stack.pair
    endpoint = endpoint_of(
        pair.prefill.spec.host, pair.prefill.spec.side_channel_port + DIGEST_PORT_OFFSET
    )
    hostile = [[], "0", {"0": [2, 2, 1]}, {"0": [0, 0, 1]}, {"-1": [2, 0, 1]}, {"0": [2, 0]},
               {"0": [True, 0, 1]}, {"0": [2, 0, 10**9]}, {"0": [2.5, 0, 1]},
               {str(g): [2, 0, 1] for g in range(65)}]  # fmt: skip
    for split in hostile:
        message = json.dumps({"op": "digest", "req": "x", "split": split}).encode()
        reply = raw_ask(endpoint, message)
        assert reply is not None and "split" in reply.get("error", ""), (split, reply)
    rng = random.Random(11)
    for _ in range(20):
        raw_ask(endpoint, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    unknown = json.dumps({"op": "digest", "req": "no-such", "split": {"0": [2, 1, 1]}})
    assert raw_ask(endpoint, unknown.encode()) == {"req": "no-such", "state": "unknown"}
    expected = alone(stack, A)
    answer = httpx.post(f"{stack.router_url}/v1/completions", json=body(pair.model, A), timeout=300)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.json()["choices"][0]["text"] == expected
    assert_alive(stack)


def test_decode_legs_with_any_lease_value_never_kill_the_engine(stack: Stack) -> None:
    pair = stack.pair
    impostor = Impostor()
    expected = alone(stack, A)
    good = lease_address(stack)
    values = [
        "tcp://127.0.0.1:1",
        [],
        42,
        {"host": "127.0.0.1"},
        {"host": "127.0.0.1", "port": -1, "epoch": good.epoch},
        {"host": "; rm -rf /", "port": good.port, "epoch": good.epoch},
        {"host": "127.0.0.1", "port": good.port, "epoch": "zz"},
        {"host": "127.0.0.1", "port": impostor.port, "epoch": good.epoch},
        {**good.to_params(), "prompt_tokens": "many", "prompt_sha256": 5},
        {**good.to_params(), "prompt_tokens": 3, "prompt_sha256": "0" * 64},
    ]
    statuses = []
    with httpx.Client(timeout=300) as client:
        for value in values:
            prefill = client.post(
                f"{pair.prefill.spec.url}/v1/completions", json=prefill_body(body(pair.model, A))
            )
            params = {**prefill.json()["kv_transfer_params"], PARAMS_KEY: value}
            answer = client.post(
                f"{pair.decode.spec.url}/v1/completions",
                json={**body(pair.model, A), "kv_transfer_params": params},
            )
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                assert answer.json()["choices"][0]["text"] == expected, value
            else:
                assert answer.status_code >= 400, answer.text
        assert_alive(stack)
        final = client.post(f"{stack.router_url}/v1/completions", json=body(pair.model, B))
    assert final.status_code == 200 and final.json()["choices"][0]["text"] == alone(stack, B)
    assert 200 in statuses  # unusable values are computed locally, not failed
    log = pair.decode.log_text()
    assert "value is unusable" in log and "answered something that is not JSON" in log


def test_requests_queued_behind_a_long_one_are_served_not_refused(stack: Stack) -> None:
    """Prefill lease 2 s; the decode engine runs one request at a time and is kept busy by a
    long one while four P/D requests queue behind it. Their engine renews their leases while
    they wait: all four answer correctly. (vLLM's stock connector renews its own lease the
    same way; without renewals every one of them was refused.)"""
    pair = stack.pair
    prompts = [f"Request {i} waits its turn at the harbour office. " * 6 for i in range(4)]
    expected = {p: alone(stack, p) for p in prompts}
    long_tokens = 1024 - 64
    results: dict[str, httpx.Response] = {}
    reruns_before = metric_sum(stack.router_url, "router_lease_reruns_total")
    refusals_before = pair.decode.log_text().count("released its KV blocks")
    with httpx.Client(timeout=600) as client:
        hold = threading.Thread(
            target=lambda: results.__setitem__(
                "long",
                client.post(
                    f"{stack.router_url}/v1/completions",
                    json=body(pair.model, "Hold the line.", long_tokens),
                ),
            )
        )
        hold.start()
        deadline = time.monotonic() + 120
        while metric_sum(pair.decode.spec.url, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the long request never ran on the decode engine"
            time.sleep(0.05)
        started = time.monotonic()
        threads = [
            threading.Thread(
                target=lambda p=p: results.__setitem__(
                    p, client.post(f"{stack.router_url}/v1/completions", json=body(pair.model, p))
                )
            )
            for p in prompts
        ]
        for thread in threads:
            thread.start()
        for thread in [*threads, hold]:
            thread.join()
        waited = time.monotonic() - started
    for prompt in prompts:
        answer = results[prompt]
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected[prompt]
    assert results["long"].status_code == 200
    # Served on the first attempt: no lease ran out, nothing was re-run.
    assert metric_sum(stack.router_url, "router_lease_reruns_total") == reruns_before
    assert pair.decode.log_text().count("released its KV blocks") == refusals_before
    # Whether the queue outlasted the lease depends on the machine; the answers may not.
    print(f"queued requests waited up to {waited:.1f} s (lease {LEASE_S} s)")
    assert_alive(stack)


class Blackhole:
    """A ZeroMQ REP server on 127.0.0.1 that takes questions and never answers."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.asked = threading.Event()
        threading.Thread(target=self.swallow, daemon=True).start()

    def swallow(self) -> None:
        try:
            self.socket.recv()
            self.asked.set()
        except zmq.ZMQError:
            return


def test_a_silent_lease_service_delays_only_the_requests_that_need_it(stack: Stack) -> None:
    """A decode leg whose prefill's lease service never answers waits for its pin (up to the
    decode engine's lease_check_timeout, 8 s here, 3 tries) off the step; meanwhile another P/D
    request on the same decode engine is answered. Ordering, not timing: with pins inside the
    engine's step, the engine would stand still until the silent pin timed out, so the other
    request could not finish first. The silent one then fails loudly."""
    pair = stack.pair
    hole = Blackhole()
    with httpx.Client(timeout=300) as client:
        prefill = client.post(
            f"{pair.prefill.spec.url}/v1/completions", json=prefill_body(body(pair.model, A))
        )
        params = prefill.json()["kv_transfer_params"]
        params = {**params, PARAMS_KEY: {**params[PARAMS_KEY], "port": hole.port}}
        stuck: list[httpx.Response] = []
        leg = threading.Thread(
            target=lambda: stuck.append(
                httpx.post(
                    f"{pair.decode.spec.url}/v1/completions",
                    json={**body(pair.model, A), "kv_transfer_params": params},
                    timeout=300,
                )
            )
        )
        leg.start()
        assert hole.asked.wait(60), "the decode engine never asked the silent lease service"
        answer = client.post(f"{stack.router_url}/v1/completions", json=body(pair.model, B))
        still_waiting = leg.is_alive()
        leg.join()
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone(stack, B)
    assert still_waiting, "the other request finished only after the silent pin timed out"
    assert stuck[0].status_code >= 400  # failed loudly (kv_load_failure_policy: fail)
    assert "no answer from the prefill engine's lease service" in pair.decode.log_text()
    assert_alive(stack)


SHORT = "The keeper mended nets."  # 23 characters: 6 tokens by the router's estimate


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_short_prompts_skip_the_prefill_hop_and_long_ones_do_not(
    stack: Stack, stream: bool
) -> None:
    """Conditional disaggregation (``short_prompt_tokens``): below the threshold a prompt
    runs colocated on the decode engine (no prefill leg, no KV over NIXL); above it, P/D.
    Both answers equal the prefill engine's alone, token for token."""
    pool = BackendPool.from_urls([stack.pair.prefill.spec.url], [stack.pair.decode.spec.url])
    settings = RouterSettings(short_prompt_tokens=32)
    decode_url = stack.pair.decode.spec.url
    with running_router(pool, settings=settings) as url, httpx.Client(timeout=300) as client:
        for prompt, short in ((SHORT, True), (A, False)):
            before = read_kv_transfer_counters(decode_url, client)
            legs_before = metric_sum(url, "router_leg_requests_total", leg="prefill")
            request = body(stack.pair.model, prompt, stream=stream)
            if stream:
                with client.stream("POST", f"{url}/v1/completions", json=request) as answer:
                    assert answer.status_code == 200, answer.read()[:500]
                    text = streamed_texts(answer)[0]
            else:
                answer = client.post(f"{url}/v1/completions", json=request)
                assert answer.status_code == 200, answer.text[:500]
                text = answer.json()["choices"][0]["text"]
            assert text == alone(stack, prompt), (prompt, short)
            moved = read_kv_transfer_counters(decode_url, client) - before
            prefill_legs = metric_sum(url, "router_leg_requests_total", leg="prefill")
            if short:
                assert moved.nixl_bytes == 0 and prefill_legs == legs_before, (moved, prompt)
            else:
                assert moved.nixl_bytes > 0 and prefill_legs == legs_before + 1, (moved, prompt)
        chosen = metric_sum(url, "router_policy_choices_total", role="colocated")
        assert chosen == metric_sum(
            url, "router_policy_choices_total", role="colocated", reason="short_prompt"
        )
        assert chosen == 1
    assert_alive(stack)


def test_a_prompt_mostly_cached_on_the_decode_engine_skips_the_prefill_hop(stack: Stack) -> None:
    """Conditional disaggregation by cache: a long prompt goes P/D, and the decode engine
    keeps its KV in its prefix cache; the same prompt grown by a few words then has fewer
    than ``short_prompt_tokens`` left to prefill there, so it runs colocated on that engine
    (``reason="cached_prefix"``: no prefill leg, no bytes over NIXL, the decode engine's own
    prefix-cache hits grow). Both answers equal the prefill engine's alone."""
    pool = BackendPool.from_urls([stack.pair.prefill.spec.url], [stack.pair.decode.spec.url])
    decode_url = stack.pair.decode.spec.url
    first = (A + B) * 2  # 924 characters: 231 tokens by the router's estimate
    grown = first + "The tide turned."
    with running_router(pool, settings=RouterSettings(short_prompt_tokens=64)) as url:
        with httpx.Client(timeout=300) as client:
            for prompt, cached in ((first, False), (grown, True)):
                before = read_kv_transfer_counters(decode_url, client)
                hits_before = metric_sum(decode_url, "vllm:prefix_cache_hits_total")
                legs_before = metric_sum(url, "router_leg_requests_total", leg="prefill")
                answer = client.post(f"{url}/v1/completions", json=body(stack.pair.model, prompt))
                assert answer.status_code == 200, answer.text[:500]
                assert answer.json()["choices"][0]["text"] == alone(stack, prompt), cached
                moved = read_kv_transfer_counters(decode_url, client) - before
                legs = metric_sum(url, "router_leg_requests_total", leg="prefill") - legs_before
                hits = metric_sum(decode_url, "vllm:prefix_cache_hits_total") - hits_before
                if cached:
                    assert moved.nixl_bytes == 0 and legs == 0 and hits > 0, (moved, legs, hits)
                else:
                    assert moved.nixl_bytes > 0 and legs == 1, (moved, legs)
        assert (
            metric_sum(url, "router_policy_choices_total", role="colocated", reason="cached_prefix")
            == 1
        )
        assert metric_sum(url, "router_policy_choices_total", role="colocated") == 1
    assert_alive(stack)


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ({"max_tokens": -1}, 400),
        ({"prompt": [True, False]}, 400),
        ({"prompt": {"text": SHORT}}, 400),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, 400),
        ({"prompt_embeds": "AAAA"}, None),  # length unknown: P/D, whatever the engine says
    ],
    ids=["negative-max-tokens", "bools", "dict-prompt", "client-kv-params", "embeds"],
)
def test_hostile_short_prompts_get_a_clear_error_and_never_skip_the_checks(
    stack: Stack, extra: dict, status: int | None
) -> None:
    """The short-prompt path takes only what the P/D path takes: malformed bodies get the
    router's 4xx before any engine, a body whose length cannot be told goes P/D, and both
    engines stay up."""
    pool = BackendPool.from_urls([stack.pair.prefill.spec.url], [stack.pair.decode.spec.url])
    with running_router(pool, settings=RouterSettings(short_prompt_tokens=32)) as url:
        request = {**body(stack.pair.model, SHORT), **extra}
        answer = httpx.post(f"{url}/v1/completions", json=request, timeout=300)
        colocated = metric_sum(url, "router_policy_choices_total", role="colocated")
        if status is not None:
            assert answer.status_code == status, answer.text[:500]
            assert "error" in answer.json()
        assert colocated == 0, answer.text[:500]  # never run on the short-prompt path
    assert_alive(stack)


def test_a_chat_body_cannot_look_short_through_a_prompt_field(stack: Stack) -> None:
    """vLLM's chat endpoint ignores ``prompt``: a long conversation with ``"prompt": ""``
    still goes P/D, and its answer equals the prefill engine's alone."""
    pool = BackendPool.from_urls([stack.pair.prefill.spec.url], [stack.pair.decode.spec.url])
    chat = {
        "model": stack.pair.model,
        "messages": [{"role": "user", "content": A}],
        "prompt": "",
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    expected = httpx.post(
        f"{stack.pair.prefill.spec.url}/v1/chat/completions", json=chat, timeout=300
    )
    assert expected.status_code == 200, expected.text[:500]
    with running_router(pool, settings=RouterSettings(short_prompt_tokens=32)) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=300)
        assert answer.status_code == 200, answer.text[:500]
        assert metric_sum(url, "router_policy_choices_total", role="colocated") == 0
        assert metric_sum(url, "router_leg_requests_total", leg="prefill") == 1
    got = answer.json()["choices"][0]["message"]["content"]
    assert got == expected.json()["choices"][0]["message"]["content"]
    assert_alive(stack)


KV_PATH = (
    "arrive",
    "first_schedule",
    "ready",
    "alloc",
    "read_posted",
    "read_done",
    "read_reported",
    "recv_seen",
    "scheduled",
)


def test_the_decode_engine_records_each_stage_of_a_requests_kv_path(stack: Stack) -> None:
    """``VLLM_HYBRID_NIXL_KV_TIMELINE``: the decode engine's scheduler and worker (two
    processes) record a P/D request's KV path, every stage in order, and
    ``bench.kv_timeline`` reads it into stage times."""
    seen = len(stack.timeline.read_text().splitlines()) if stack.timeline.exists() else 0
    answer = httpx.post(
        f"{stack.router_url}/v1/completions", json=body(stack.pair.model, A), timeout=300
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone(stack, A)
    requests = requests_in(stack.timeline.read_text().splitlines()[seen:])
    complete = [times for times in requests.values() if set(KV_PATH) <= times.keys()]
    assert len(complete) == 1, requests  # this request, every stage recorded
    times = [complete[0][event] for event in KV_PATH]
    assert times == sorted(times), dict(zip(KV_PATH, times, strict=True))
    assert len(stage_times(requests)["total"]) == 1  # its read was used (not failed)
    summary = summarize(requests)
    assert summary["complete"] == 1 and summary["stages_ms"]["total"]["p50"] > 0
    assert_alive(stack)
