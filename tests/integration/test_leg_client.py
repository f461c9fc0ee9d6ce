"""The legs' HTTP client (``router/leg_http.py``, ``router/engine_connection.py``) against
real TCP servers on 127.0.0.1: kept-alive reuse, streams read chunk by chunk, a stream left
unfinished closing its connection (the engine aborts the request), and every way an engine
can fail a leg, each reported with whether the engine may have received the request.

The servers are asyncio servers that answer with scripted HTTP bytes, so an engine that
stalls, dies mid-answer or speaks garbage can be played exactly; a uvicorn app checks the
client against the server vLLM itself runs on."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvicorn

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.router.engine_connection import HIGH_WATER_BYTES
from vllm_hybrid_nixl.router.leg_http import LegClient, LegTimeout, LegTransportError, header_lines
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.integration

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedEngine:
    """An HTTP server on 127.0.0.1 whose every connection runs ``script``; it counts the
    connections it accepted and keeps the requests it read."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()

    @asynccontextmanager
    async def legs(self, **settings: float) -> AsyncIterator[tuple[str, LegClient]]:
        """This engine running, and an open leg client (``settings`` for the router), closed
        before the engine stops."""
        async with self.running() as url:
            legs = await client(**settings).open()
            try:
                yield url, legs
            finally:
                await legs.aclose()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def json_answer(status: int, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    reason = {200: b"OK", 400: b"Bad Request", 503: b"Service Unavailable"}[status]
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        reason,
        len(body),
        body,
    )


def client(**settings: float) -> LegClient:
    return LegClient(RouterSettings(**settings), {"Authorization": "Bearer engine-key"})


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 120))


def test_answers_are_read_whole_and_the_connection_is_kept_for_the_next_leg() -> None:
    async def answer_twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(json_answer(200, {"n": len(engine.requests)}))
            await writer.drain()

    engine = ScriptedEngine(answer_twice)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            first = await legs.post(f"{url}/v1/completions", {"a": 1}, False, legs.timeout(5))
            second = await legs.post(f"{url}/v1/completions", {"a": 2}, False, legs.timeout(5))
        assert (first.status, first.json(), second.json()) == (200, {"n": 1}, {"n": 2})
        assert first.content_type == "application/json"
        assert engine.connections == 1  # the second leg reused the first one's connection
        head, body = engine.requests[1].split(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nAuthorization: Bearer engine-key" in head
        assert b"\r\nContent-Type: application/json" in head
        assert json.loads(body) == {"a": 2}

    run(test)


def test_a_stream_comes_chunk_by_chunk_and_a_finished_one_returns_its_connection() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    taken: asyncio.Queue[None] = asyncio.Queue()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(SSE_HEAD)
            for event in events:
                writer.write(chunk(event))
                await writer.drain()
                await taken.get()  # the next event only once the client has this one
            writer.write(b"0\r\n\r\n")

    engine = ScriptedEngine(stream)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            for _ in range(2):
                answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
                assert answer.status == 200 and answer.content_type == "text/event-stream"
                got = []
                while piece := await answer.next_chunk():
                    got.append(piece)
                    taken.put_nowait(None)
                answer.close()
                answer.close()  # a second close changes nothing
                assert got == events
        assert engine.connections == 1

    run(test)


def test_a_stream_left_unfinished_closes_its_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # returns at the client's close
        engine.closed_by_client.set()

    engine = ScriptedEngine(endless)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
            assert await answer.next_chunk() == b"data: 1\n\n"
            answer.close()
            await asyncio.wait_for(engine.closed_by_client.wait(), 5)
            second = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
            second.close()
        assert engine.connections == 2  # the unfinished one was not reused

    run(test)


def test_an_error_status_comes_back_read_whole_even_for_a_stream() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(json_answer(400, {"error": {"message": "prompt too long"}}))
        await writer.drain()
        await reader.read()

    engine = ScriptedEngine(refuse)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
        assert answer.status == 400
        assert answer.json()["error"]["message"] == "prompt too long"
        assert answer.exchange is None and await answer.next_chunk() == b""

    run(test)


def test_a_refused_connection_was_not_delivered() -> None:
    port = free_port()

    async def test() -> None:
        legs = await client().open()
        with pytest.raises(LegTransportError) as caught:
            await legs.post(f"http://127.0.0.1:{port}/v1/completions", {}, True, legs.timeout(5))
        await legs.aclose()
        assert caught.value.kind == "unreachable" and not caught.value.delivered

    run(test)


def test_an_engine_silent_before_its_headers_times_out_as_delivered() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        await reader.read()

    engine = ScriptedEngine(silent)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            with pytest.raises(LegTransportError) as caught:
                await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(0.3))
        assert caught.value.kind == "timeout" and caught.value.delivered

    run(test)


def test_a_stream_silent_past_the_read_deadline_breaks_and_one_that_trickles_does_not() -> None:
    async def trickle_then_stall(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await engine.read_request(reader)
        writer.write(SSE_HEAD)
        for index in range(6):  # tokens far less than the read deadline apart
            writer.write(chunk(b"data: %d\n\n" % index))
            await writer.drain()
            await asyncio.sleep(0.02)
        await reader.read()  # then silence

    engine = ScriptedEngine(trickle_then_stall)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
            got = []
            with pytest.raises(LegTransportError) as caught:
                while True:
                    got.append(await answer.next_chunk())
            answer.close()
        assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(6))
        assert caught.value.kind == "timeout" and caught.value.delivered

    run(test)


def test_an_answer_past_the_whole_deadline_times_out_although_bytes_keep_coming() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)

    engine = ScriptedEngine(trickle)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            with pytest.raises(LegTransportError) as caught:
                await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(60, 0.5))
        assert caught.value.kind == "timeout" and caught.value.delivered

    run(test)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(SSE_HEAD + chunk(b"data: 1\n\n"), id="closed-mid-stream"),
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", id="closed-short"),
        pytest.param(b"SMTP ready\r\n\r\n", id="not-http"),
        pytest.param(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n",
            id="upgrade",
        ),
    ],
)
def test_an_engine_that_breaks_its_answer_fails_the_leg_as_delivered(answer: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(answer)
        await writer.drain()

    engine = ScriptedEngine(broken)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            with pytest.raises(LegTransportError) as caught:
                response = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
                while await response.next_chunk():
                    pass
        assert caught.value.kind == "unreachable" and caught.value.delivered

    run(test)


def test_legs_over_the_connection_limit_wait_for_one_and_give_up_at_the_connect_deadline() -> None:
    async def stream_until_closed(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await engine.read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()

    engine = ScriptedEngine(stream_until_closed)

    async def test() -> None:
        async with engine.legs(max_connections=1) as (url, legs):
            first = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(30))
            with pytest.raises(LegTransportError) as caught:  # gives up waiting at 0.3 s
                await legs.post(f"{url}/v1/completions", {}, True, LegTimeout(0.3, 30))
            assert caught.value.kind == "timeout" and not caught.value.delivered
            waiting = asyncio.ensure_future(
                legs.post(f"{url}/v1/completions", {}, True, LegTimeout(60, 30))
            )
            await asyncio.sleep(0.1)
            assert not waiting.done()  # still waiting for the one connection
            first.close()  # unfinished: closed, which frees the slot
            second = await asyncio.wait_for(waiting, 60)
            assert await second.next_chunk() == b"data: 1\n\n"
            second.close()
        assert engine.connections == 2

    run(test)


def test_an_idle_connection_past_the_keepalive_expiry_is_not_reused() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(json_answer(200, {}))
            await writer.drain()

    engine = ScriptedEngine(answer)

    async def test() -> None:
        async with engine.legs(keepalive_expiry_s=0.2) as (url, legs):
            await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
            await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
            assert engine.connections == 1
            await asyncio.sleep(0.4)
            await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
        assert engine.connections == 2

    run(test)


def test_idle_connections_are_closed_at_the_keepalive_expiry_without_another_leg() -> None:
    """After a burst, the connections it opened are closed once idle ``keepalive_expiry_s``
    (not left open until the next leg or the engine's own keep-alive)."""

    expiry_s = 0.5
    burst_in = asyncio.Event()
    idle_for: list[float] = []  # per connection: from its answer's write to its close

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = None
        while await engine.read_request(reader):
            await burst_in.wait()  # every leg of the burst holds a connection of its own
            writer.write(json_answer(200, {}))
            await writer.drain()
            answered = asyncio.get_running_loop().time()
        idle_for.append(asyncio.get_running_loop().time() - answered)

    engine = ScriptedEngine(answer)

    async def test() -> None:
        async with engine.legs(keepalive_expiry_s=expiry_s) as (url, legs):
            burst = [
                asyncio.ensure_future(
                    legs.post(f"{url}/v1/completions", {}, False, legs.timeout(30))
                )
                for _ in range(4)
            ]
            while len(engine.requests) < 4:
                await asyncio.sleep(0.01)
            burst_in.set()
            await asyncio.gather(*burst)
            for _ in range(3000):  # closed with no further leg (a slow machine only delays it)
                if len(idle_for) == 4:
                    break
                await asyncio.sleep(0.01)
        assert engine.connections == 4 and len(idle_for) == 4, idle_for
        assert min(idle_for) >= expiry_s * 0.9, idle_for  # kept for the expiry, not less

    run(test)


def test_a_reader_behind_stops_reading_the_engine_and_still_gets_every_byte() -> None:
    total = 8 * HIGH_WATER_BYTES
    piece = b"y" * 16384

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(SSE_HEAD)
        for _ in range(total // len(piece)):
            writer.write(chunk(piece))
            await writer.drain()  # waits while the router does not read
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    engine = ScriptedEngine(flood)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(3))
            connection = answer.exchange.connection
            for _ in range(3000):
                if connection._paused:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(4.5)  # past the read deadline: a lagging reader is no timeout
            # held at the mark plus at most one socket read (uvloop reads up to 256 kB)
            assert connection._paused and connection._buffered < 2 * HIGH_WATER_BYTES
            received = 0
            while data := await answer.next_chunk():
                received += len(data)
            answer.close()
        assert received == total

    run(test)


def test_an_interim_answer_is_skipped_and_the_connection_stays_in_step() -> None:
    """A 1xx (here 103 Early Hints) before the real answer is not the answer: taking it as
    one would leave the real answer to be read as the next leg's."""

    async def hints_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(json_answer(200, {"n": len(engine.requests)}))
            await writer.drain()

    engine = ScriptedEngine(hints_first)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            first = await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
            second = await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
        assert (first.status, first.json()) == (200, {"n": 1})
        assert (second.status, second.json()) == (200, {"n": 2})
        assert first.content_type == "application/json" and engine.connections == 1

    run(test)


def test_an_answer_that_ends_at_the_close_is_read_whole() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"ok": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"true}")
        await writer.drain()

    engine = ScriptedEngine(close_delimited)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, False, legs.timeout(5))
        assert (answer.status, answer.json()) == (200, {"ok": True})

    run(test)


def test_an_answer_ending_at_the_close_that_times_out_is_not_a_clean_end() -> None:
    """A close-delimited answer whose engine goes silent: the read deadline fails it, and
    the close that follows must not turn the failure into a complete answer."""

    async def silent_after_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await reader.read()

    engine = ScriptedEngine(silent_after_head)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            answer = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(0.5))
            assert await answer.next_chunk() == b"data: 1\n\n"
            await asyncio.sleep(1.5)  # not reading: the deadline fails it, the close follows
            with pytest.raises(LegTransportError) as caught:
                await answer.next_chunk()
            answer.close()
        assert caught.value.kind == "timeout"

    run(test)


def test_a_closed_stream_reads_nothing_more_even_when_its_connection_serves_again() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(SSE_HEAD + chunk(b"data: %d\n\n" % len(engine.requests)))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    engine = ScriptedEngine(stream)

    async def test() -> None:
        async with engine.legs() as (url, legs):
            first = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
            assert await first.next_chunk() == b"data: 1\n\n"
            assert await first.next_chunk() == b""
            first.close()  # read whole: its connection goes back to the pool
            second = await legs.post(f"{url}/v1/completions", {}, True, legs.timeout(5))
            assert await first.next_chunk() == b""  # not the second answer's bytes
            assert await second.next_chunk() == b"data: 2\n\n"
            second.close()
        assert engine.connections == 1

    run(test)


def test_a_waiter_cancelled_after_its_wake_up_passes_the_connection_on() -> None:
    """With one connection allowed: a leg woken for the freed connection but cancelled
    before it ran (its client left) must not keep the next waiter waiting for its whole
    connect deadline."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await engine.read_request(reader):
            writer.write(json_answer(200, {}))
            await writer.drain()

    engine = ScriptedEngine(answer)

    async def test() -> None:
        async with engine.legs(max_connections=1, connect_timeout_s=600) as (url, legs):
            timeout = legs.timeout(600)
            held = await legs.post(f"{url}/v1/completions", {}, True, timeout)  # 200 stream
            woken = asyncio.ensure_future(legs.post(f"{url}/v1/completions", {}, False, timeout))
            later = asyncio.ensure_future(legs.post(f"{url}/v1/completions", {}, False, timeout))
            await asyncio.sleep(0.1)
            assert not woken.done() and not later.done()
            await held.exchange.read_all()
            held.close()  # wakes `woken` ...
            woken.cancel()  # ... which is cancelled before it runs
            answer = await asyncio.wait_for(later, 60)  # without the hand-on: waits 600 s
        assert answer.status == 200 and woken.cancelled()

    run(test)


def test_a_header_value_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="forbids"):
        header_lines({"Authorization": "Bearer a\r\nX-Evil: 1"})


def test_the_client_reads_uvicorn_as_vllm_serves_with_it() -> None:
    peers: set[tuple[str, int]] = set()

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        peers.add(tuple(scope["client"]))
        body = (await receive())["body"]
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for word in json.loads(body)["words"]:
            await send({"type": "http.response.body", "body": word.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def test() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        legs = await client().open()
        words = ["hybrid ", "state ", "moves"]
        for _ in range(2):
            answer = await legs.post(
                f"http://127.0.0.1:{port}/v1/completions", {"words": words}, True, legs.timeout(5)
            )
            got = b""
            while data := await answer.next_chunk():
                got += data
            answer.close()
            assert got == b"hybrid state moves"
        await legs.aclose()
        server.should_exit = True
        await serving
        assert len(peers) == 1  # both legs on one kept-alive connection

    run(test)
