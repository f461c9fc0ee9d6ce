"""The relayed decode stream ends its leg exactly once however the client behaves: a client
gone as the stream starts, one that leaves mid-stream, or one that reads to the end (and
when the server stops, or fails to write, while the first event goes out). A
leg left open would keep the engine connection (the engine never aborts the request) and
the engine's in-flight count one too high, which least-in-flight routing reads for every
later request. The router's real objects (pool, health tracker, metrics, handler), driven
through the ASGI interface the way uvicorn drives them; the engine side is an async
iterator of SSE chunks, read a chunk per await as the relay reads an engine's stream (no
engine needed to show the bookkeeping)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.completions import CompletionHandler, FanOutStream, RelayedStream
from vllm_hybrid_nixl.router.fanout import Part
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.leg_http import LegResponse, LegTransportError
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.models import ServedModels
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.proxy import DecodeAnswer, Disaggregator
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.integration

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


class Relay:
    """One relayed stream over real router objects, with what it ended as."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        pool = BackendPool.from_urls(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
        settings = RouterSettings()
        self.health = HealthTracker(pool.all())
        self.metrics = RouterMetrics()
        proxy = Disaggregator(pool, PairingTable(pool.all()), self.health, self.metrics, settings)
        handler = CompletionHandler(
            proxy, self.health, self.metrics, ServedModels(pool, 1.0), settings
        )
        self.decode = pool.decode[0]
        proxy.leg_started(self.decode)  # the decode leg is in flight while it streams
        self.outcomes: list[str] = []
        answer = DecodeAnswer(pool.prefill[0], self.decode, ScriptedStream(chunks), b"data: 0\n\n")
        self.stream = RelayedStream(answer, "req-1", handler, self.outcomes.append)

    @property
    def in_flight(self) -> int:
        return self.health.in_flight(self.decode)


class ScriptedStream(LegResponse):
    """A decode engine's open 200 stream whose chunks are ``chunks``, read the way
    ``LegResponse.next_chunk`` reads an engine's: a chunk per await, ``b""`` at the end."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(200, "text/event-stream")
        self.chunks = chunks

    async def next_chunk(self) -> bytes:
        return await anext(self.chunks, b"")


async def tokens(count: int, pause_s: float = 0.0) -> AsyncIterator[bytes]:
    for index in range(1, count + 1):
        if pause_s:
            await asyncio.sleep(pause_s)
        yield f"data: {index}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def never_disconnects() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


async def disconnects_at_once() -> dict:
    return {"type": "http.disconnect"}


def test_a_relay_that_ran_ends_its_leg_once_with_every_chunk_sent() -> None:
    relay, sent = Relay(tokens(3)), []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(relay.stream(SCOPE, never_disconnects, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    assert sent[-1]["more_body"] is False
    assert relay.outcomes == ["ok"] and relay.in_flight == 0


def test_a_client_gone_as_the_stream_starts_still_ends_the_leg() -> None:
    relay = Relay(tokens(1000, pause_s=0.01))

    async def send(message: dict) -> None:
        await asyncio.sleep(0)

    asyncio.run(relay.stream(SCOPE, disconnects_at_once, send))
    assert relay.outcomes == ["client_disconnected"] and relay.in_flight == 0


def test_the_headers_and_first_event_go_out_from_the_response_task_itself() -> None:
    """The first token reaches the client from the response's own task, not from a task
    started for the relay (which would cost a turn of the event loop first); what follows
    is relayed by that task."""
    relay, senders = Relay(tokens(2)), []

    async def send(message: dict) -> None:
        senders.append(asyncio.current_task())

    async def respond() -> asyncio.Task | None:
        await relay.stream(SCOPE, never_disconnects, send)
        return asyncio.current_task()

    own = asyncio.run(respond())
    assert senders[0] is own and senders[1] is own
    assert all(task is not own for task in senders[2:]) and len(senders) > 2
    assert relay.outcomes == ["ok"]


def test_a_server_stopping_while_the_first_event_is_sent_ends_the_leg_once() -> None:
    """Cancelled while its first send blocks (a client that stopped reading; the server
    shutting down): counted as a client gone, the leg ended once, the cancel propagates."""
    relay = Relay(tokens(10))

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)

    async def cancel_it() -> None:
        task = asyncio.ensure_future(relay.stream(SCOPE, never_disconnects, send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert relay.outcomes == ["client_disconnected"] and relay.in_flight == 0
    assert relay.metrics.client_disconnects._value.get() == 1


@pytest.mark.parametrize("failing_send", [2, 4], ids=["first_event", "mid_stream"])
def test_a_send_that_fails_is_a_router_error_not_a_client_leaving(failing_send: int) -> None:
    """The server's write fails on the first event (send 2, after the headers) or later on."""
    relay, sent = Relay(tokens(10)), []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == failing_send:
            raise RuntimeError("the server could not write")

    with pytest.raises(RuntimeError):
        asyncio.run(relay.stream(SCOPE, never_disconnects, send))
    assert relay.outcomes == ["router_error"] and relay.in_flight == 0
    assert relay.metrics.client_disconnects._value.get() == 0


def test_a_client_leaving_mid_stream_stops_the_relay_and_ends_the_leg_once() -> None:
    relay, sent = Relay(tokens(1000, pause_s=0.01)), []

    async def leaves_after_a_while() -> dict:
        await asyncio.sleep(0.1)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(relay.stream(SCOPE, leaves_after_a_while, send))
    assert 1 < len(sent) < 1000  # some chunks went out, then the relay stopped
    assert relay.outcomes == ["client_disconnected"] and relay.in_flight == 0
    assert relay.metrics.client_disconnects._value.get() == 1


def test_a_broken_engine_stream_ends_with_an_error_event_not_silently() -> None:
    async def breaks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise LegTransportError("unreachable", "engine unreachable: reset", delivered=True)

    relay, sent = Relay(breaks()), []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(relay.stream(SCOPE, never_disconnects, send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert b'"error"' in body and body.endswith(b"data: [DONE]\n\n")
    assert b"127.0.0.1" not in body  # engines by name only
    assert relay.outcomes == ["decode_stream_broken"] and relay.in_flight == 0


def test_a_batch_stream_whose_send_fails_mid_stream_is_a_router_error() -> None:
    """The merged stream of a batched request (two parts, two decode legs): a failing write
    is the router's error, and both legs end."""
    relay = Relay(tokens(1))  # for its router objects
    handler, decode = relay.stream.handler, relay.decode
    handler.proxy.leg_started(decode)  # a second leg in flight, one per part
    parts = [Part(0, True, {}), Part(1, True, {})]
    answers = [
        DecodeAnswer(decode, decode, ScriptedStream(tokens(10)), b"data: 0\n\n") for _ in parts
    ]
    outcomes: list[str] = []
    stream = FanOutStream(parts, answers, handler, outcomes.append)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == 4:
            raise RuntimeError("the server could not write")

    with pytest.raises(RuntimeError):
        asyncio.run(stream(SCOPE, never_disconnects, send))
    assert outcomes == ["router_error"] and relay.in_flight == 0
    assert relay.metrics.client_disconnects._value.get() == 0
