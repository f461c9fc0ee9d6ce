"""One kept-alive HTTP/1.1 connection from the router to an engine, one exchange at a time,
its answers parsed by httptools (llhttp, the C parser uvicorn serves with).

The legs' client used to be aiohttp's. Exploratory cProfile runs on the router's
short-prompt path (2-core VM) had aiohttp spend more CPU on each request and each streamed
chunk than the router's own code did (request objects, a stream reader, a read timer moved
on every chunk).
Here a chunk costs one parser callback and, when a reader waits, one future; a read deadline
is one timer per exchange, moved only when it fires (:meth:`EngineConnection.watch`).
"""

from __future__ import annotations

import asyncio

import httptools

#: Body bytes held for a reader that has not taken them before the engine's socket is no
#: longer read (the engine then waits on TCP), so a slow client cannot make the router buffer
#: a whole answer.
HIGH_WATER_BYTES = 256 * 1024


class AnswerTimeout(TimeoutError):
    """The engine was silent longer than the read deadline, or the whole deadline passed."""


class EngineConnection(asyncio.Protocol):
    """A connection to one engine; :meth:`begin` starts an exchange (the request is
    written by the caller), :meth:`wait_headers` and :meth:`next_body` read its answer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = loop.time()
        self._watchdog: asyncio.TimerHandle | None = None
        self._read_s, self._deadline = 0.0, None
        self._reset()

    @property
    def usable(self) -> bool:
        """Open, and not being closed (a transport closes a loop pass before it is lost)."""
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def _reset(self) -> None:
        if getattr(self, "_paused", False) and self.usable:
            self.transport.resume_reading()  # type: ignore[union-attr]
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.content_type = 0, "application/json"
        self.headers_done = self.complete = False
        self.keep_alive = True
        self._framed = False  # a Content-Length or chunked body (else it ends at the close)
        self._interim = False  # a 1xx answer is being read: the real one follows
        self.failure: BaseException | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.last_data = self.loop.time()

    # ---- one exchange ------------------------------------------------------------------

    def begin(self, request: bytes, read_s: float, deadline: float | None) -> None:
        """Writes ``request`` and arms the read deadlines: ``read_s`` of silence, and
        ``deadline`` (event-loop time) for the whole answer."""
        self._reset()
        self._read_s = read_s
        self._deadline = deadline
        self.transport.write(request)  # type: ignore[union-attr]
        self.watch()  # after the write: a deadline already past fails a delivered leg

    def watch(self) -> None:
        """(Re)arms the one timer that enforces the deadlines: it fires at the earliest
        moment either could pass, and fails the exchange or arms itself again."""
        self._watchdog = None
        if self.complete or self.failure is not None:
            return
        now = self.loop.time()
        if self._paused:  # the reader is behind, not the engine: silence is ours
            self.last_data = now
        expires = self.last_data + self._read_s
        if self._deadline is not None:
            expires = min(expires, self._deadline)
        if now >= expires:
            late = "answer" if self._deadline is not None and now >= self._deadline else "byte"
            self.fail(AnswerTimeout(f"no {late} from the engine within the deadline"))
            return
        self._watchdog = self.loop.call_at(expires, self.watch)

    def finish(self) -> bool:
        """Ends the exchange; True when the connection can carry another one (the answer
        was read whole and the engine keeps the connection open)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        reusable = self.complete and self.keep_alive and self.failure is None and self.usable
        if not reusable and self.transport is not None:
            self.transport.close()  # an unfinished answer: the engine aborts the request
        elif self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self.idle_since = self.loop.time()
        return reusable

    async def wait_headers(self) -> None:
        """Until the answer's status line and headers are in."""
        while not self.headers_done:
            await self._wait()

    async def next_body(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some), ``b""`` once
        the answer is complete."""
        while not self._body:
            if self.complete:
                return b""
            await self._wait()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()
        return body

    async def _wait(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._waiter is not None:  # a second reader would steal the first one's wake-up
            raise RuntimeError("an engine answer is being read by two readers at once")
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.failure is not None and not self.complete:
            raise self.failure

    def fail(self, exc: BaseException) -> None:
        """The exchange failed with ``exc``: readers get it, the connection is closed."""
        if self.failure is None and not self.complete:
            self.failure = exc
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.fail(ConnectionError(f"the engine's answer is not valid HTTP ({exc})"))

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        ends_at_close = self.headers_done and not self._framed and self.failure is None
        if exc is None and ends_at_close and not self.complete:
            self.complete, self.keep_alive = True, False  # an answer that ends at the close
            self._wake()
        if not self.complete:
            self.fail(exc or ConnectionResetError("the engine closed the connection"))

    # ---- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101:  # a protocol switch nobody asked for: not an answer to a leg
            self.fail(ConnectionError("the engine answered 101 Switching Protocols"))
            return
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): the answer follows
            self._interim, self._framed = True, False
            self.content_type = "application/json"
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:  # the parser goes on to the answer that follows it
            self._interim = False
            return
        self.complete = True
        self._wake()
