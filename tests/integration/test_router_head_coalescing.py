"""The router's HTTP protocol sends a response's head in the same write as its first body
bytes (``router/head_coalescing.py``), and never holds a head longer than one pass of the
event loop: a real uvicorn server on 127.0.0.1 with the router's protocol class, read by a
raw socket so what each read returns is seen, and the transport wrapper on a real
connection, its writes counted (a reader on loopback often gets two quick writes in one read
anyway, so only the count shows that they were one)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn

from vllm_hybrid_nixl.router.limits import uvicorn_http_protocol

pytestmark = pytest.mark.integration


async def app(scope: dict, receive: Callable, send: Callable) -> None:
    """``/stream``: a head, a first event, a pause, a second event; ``/empty``: a 204;
    ``/close``: a whole answer on a connection the server then closes."""
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/json":
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if scope["path"] == "/close":
        headers = [(b"content-length", b"2"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
    await asyncio.sleep(0.3)
    await send({"type": "http.response.body", "body": b"data: second\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http=uvicorn_http_protocol(5.0), log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def request(port: int, path: str, method: str = "GET") -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    client.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return client


def test_a_stream_through_the_protocol_arrives_whole_and_in_order(
    server_port: int,
) -> None:
    for _ in range(5):
        with request(server_port, "/stream") as client:
            first = client.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n"), first
            assert b"data: first\n\n" in first, f"the head came without the first event: {first!r}"
            rest = b""
            while not rest.endswith(b"0\r\n\r\n"):
                rest += client.recv(65536)
            assert b"data: second\n\n" in rest


def test_the_head_of_an_answer_to_head_is_not_held(server_port: int) -> None:
    """uvicorn writes no body for HEAD: nothing follows the head, so only the flush at the
    loop's next pass sends it (the connection stays open)."""
    with request(server_port, "/json", method="HEAD") as client:
        answer = client.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n"), answer


@pytest.mark.parametrize("path", ["/empty", "/close"])
def test_a_head_without_a_body_to_follow_is_not_held(server_port: int, path: str) -> None:
    with request(server_port, path) as client:
        answer = client.recv(65536)
        if path == "/close":
            while chunk := client.recv(65536):
                answer += chunk
    status = b"204 No Content" if path == "/empty" else b"200 OK"
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    if path == "/close":
        assert answer.endswith(b"\r\n\r\nok")


class CountingTransport:
    """A real connection's transport that counts the writes reaching it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport, self.writes = transport, []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


def test_a_head_and_the_write_after_it_reach_the_socket_as_one_write() -> None:
    from vllm_hybrid_nixl.router.head_coalescing import HeadHoldingTransport

    async def test() -> list[list[bytes]]:
        received = bytearray()
        all_read = asyncio.Event()

        async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.extend(await reader.read())  # to the client's close
            all_read.set()
            writer.close()

        server = await asyncio.start_server(peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        counted = CountingTransport(transport)
        holding = HeadHoldingTransport(counted, loop)  # type: ignore[arg-type]
        rounds = []
        holding.write(b"HTTP/1.1 200 OK\r\n\r\n")
        holding.write(b"first")
        rounds.append(list(counted.writes))  # one write: head and first body
        holding.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        rounds.append(list(counted.writes))  # held ...
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        rounds.append(list(counted.writes))  # ... for one pass of the loop only
        holding.write(b"HTTP/1.1 200 OK\r\n\r\n")
        holding.close()  # a held head goes out before the connection closes
        await asyncio.wait_for(all_read.wait(), 60)
        server.close()
        rounds.append([bytes(received)])
        return rounds

    rounds = asyncio.run(asyncio.wait_for(test(), 30))
    assert rounds[0] == [b"HTTP/1.1 200 OK\r\n\r\nfirst"]
    assert rounds[1] == rounds[0]
    assert rounds[2] == [*rounds[0], b"HTTP/1.1 204 No Content\r\n\r\n"]
    assert rounds[3] == [
        b"HTTP/1.1 200 OK\r\n\r\nfirstHTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"
    ]
