"""The HTTP client of the legs: kept-alive connections to each engine (at most
``max_connections`` open per engine, idle ones dropped after ``keepalive_expiry_s``), each
answer parsed by httptools (:mod:`.engine_connection`).

The legs are the router's hot path: every request and every streamed token passes here, so
they do not go through a general-purpose client (probes and model lists keep httpx). Every
failure surfaces as :class:`LegTransportError` saying whether the engine may have received
the request.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm_hybrid_nixl.router.engine_connection import EngineConnection
from vllm_hybrid_nixl.router.limits import within
from vllm_hybrid_nixl.router.settings import RouterSettings


class LegTransportError(Exception):
    """A leg's HTTP exchange failed: ``kind`` is ``timeout`` or ``unreachable``;
    ``delivered`` says whether the engine may have received the request."""

    def __init__(self, kind: str, detail: str, delivered: bool) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.delivered = kind, detail, delivered


def transport_error(exc: BaseException, delivered: bool) -> LegTransportError:
    """What ``exc``, raised while connecting (``delivered`` False) or after the request was
    written (True), means for the leg."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return LegTransportError("timeout", f"timed out ({exc or type(exc).__name__})", delivered)
    return LegTransportError("unreachable", f"engine unreachable: {exc!r}", delivered)


#: What connecting, writing and reading a leg can raise (anything else is a bug): OSError
#: holds ConnectionError and TimeoutError (so ``AnswerTimeout``); asyncio's TimeoutError is
#: its own class before Python 3.11.
LEG_FAILURES = (OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class LegTimeout:
    """``connect_s``: to get a connection (the wait for a free one included); ``read_s``:
    the longest silence while the answer is read; ``whole_s``: the whole answer, if bounded."""

    connect_s: float
    read_s: float
    whole_s: float | None = None


@dataclass(frozen=True)
class EngineAddress:
    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> EngineAddress:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an engine URL must be http(s)://host:port/..., not {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = parts.path or "/"
        return cls(
            parts.scheme, parts.hostname, port, path + (f"?{parts.query}" if parts.query else "")
        )

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class EnginePool:
    """The connections to one engine: idle ones reused newest first, at most ``limit`` open,
    a caller over the limit waiting (within its connect deadline) for one to be returned."""

    def __init__(
        self, address: EngineAddress, limit: int, keepalive_s: float, tls: ssl.SSLContext | None
    ) -> None:
        self.address, self.limit, self.keepalive_s, self.tls = address, limit, keepalive_s, tls
        self.idle: list[EngineConnection] = []  # oldest first; reused newest first
        self.open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        self.closed = False

    async def acquire(self, connect_s: float) -> EngineConnection:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_s
        while True:
            if self.closed:
                raise ConnectionError("the router's leg client is closed")
            while self.idle:
                connection = self.idle.pop()
                if not connection.usable or loop.time() - connection.idle_since > self.keepalive_s:
                    self._drop(connection)
                    continue
                return connection
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"no connection to the engine within {connect_s:g} s")
            if self.open < self.limit:
                return await self._connect(loop, remaining)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await within(waiter, remaining)
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled or late:
                    self._wake_one()  # the freed connection goes to the next waiter
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> EngineConnection:
        self.open += 1
        try:
            _, connection = await within(
                loop.create_connection(
                    lambda: EngineConnection(loop),
                    self.address.host,
                    self.address.port,
                    ssl=self.tls,
                ),
                timeout_s,
            )
        except BaseException:
            self.open -= 1
            self._wake_one()
            raise
        return connection

    def release(self, connection: EngineConnection) -> None:
        """Ends ``connection``'s exchange: kept for the next leg if it can carry one."""
        if connection.finish() and not self.closed:
            self.idle.append(connection)
            self._schedule_sweep()
        else:
            self._drop(connection)
        self._wake_one()

    def _schedule_sweep(self) -> None:
        """Idle connections are closed once idle ``keepalive_s``, whether or not another
        leg comes: one timer, due when the oldest idle connection expires."""
        if self._sweep is None and self.idle:
            loop = asyncio.get_running_loop()
            due = self.idle[0].idle_since + self.keepalive_s + 0.01  # timers may fire early
            self._sweep = loop.call_at(due, self._sweep_expired)

    def _sweep_expired(self) -> None:
        self._sweep = None
        now = asyncio.get_running_loop().time()
        kept = []
        for connection in self.idle:
            if not connection.usable or now - connection.idle_since >= self.keepalive_s:
                self._drop(connection)
            else:
                kept.append(connection)
        self.idle = kept
        self._schedule_sweep()

    def _drop(self, connection: EngineConnection) -> None:
        self.open -= 1
        if connection.transport is not None and not connection.transport.is_closing():
            connection.transport.close()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in self.idle:
            self._drop(connection)
        self.idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class Exchange:
    """An engine's answer being read from one pooled connection; :meth:`close` returns the
    connection (or closes it, if the answer was not read whole) exactly once."""

    def __init__(self, pool: EnginePool, connection: EngineConnection) -> None:
        self.pool, self.connection = pool, connection
        self.ended = False

    async def next_chunk(self) -> bytes:
        if self.ended:  # the connection may carry another exchange by now
            return b""
        try:
            return await self.connection.next_body()
        except LEG_FAILURES as exc:
            raise transport_error(exc, delivered=True) from exc

    async def read_all(self) -> bytes:
        chunks = []
        while chunk := await self.next_chunk():
            chunks.append(chunk)
        return b"".join(chunks)

    @property
    def complete(self) -> bool:
        return self.connection.complete

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.pool.release(self.connection)


@dataclass
class LegResponse:
    """An engine's answer: status and content type; the whole body, or (a 200 stream) the
    open answer to read with :meth:`next_chunk` and end with :meth:`close`."""

    status: int
    content_type: str
    body: bytes = b""
    exchange: Exchange | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    async def next_chunk(self) -> bytes:
        """The stream's next bytes as they arrive, ``b""`` at its end (one await per chunk: the
        relay calls this for every token); raises :class:`LegTransportError` if it breaks."""
        if self.exchange is None:
            return b""
        return await self.exchange.next_chunk()

    def close(self) -> None:
        """Ends the stream: a finished one returns its connection to the pool, an unfinished
        one closes it (the engine aborts the request on the disconnect)."""
        if self.exchange is not None:
            self.exchange.close()


def header_lines(headers: dict[str, str]) -> bytes:
    """``headers`` as HTTP header lines; refuses a name or value that would break the
    request apart (a line break in a configured key)."""
    lines = []
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n\0") or ":" in name:
            raise ValueError(f"header {name!r} has a character HTTP forbids there")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


class LegClient:
    """POSTs the legs' JSON bodies to engines over pooled connections; opened and closed in
    the router's event loop (:meth:`open`, :meth:`aclose`)."""

    def __init__(self, settings: RouterSettings, headers: dict[str, str]) -> None:
        self.settings = settings
        self._headers = header_lines({**headers, "Content-Type": "application/json"})
        self._pools: dict[tuple[str, str, int], EnginePool] = {}
        self._addresses: dict[str, EngineAddress] = {}
        self._tls: ssl.SSLContext | None = None
        self._opened = self._closed = False

    async def open(self) -> LegClient:
        self._opened = True
        return self

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()

    def timeout(self, read_s: float, whole_s: float | None = None) -> LegTimeout:
        return LegTimeout(self.settings.connect_timeout_s, read_s, whole_s)

    def _pool(self, address: EngineAddress) -> EnginePool:
        key = (address.scheme, address.host, address.port)
        pool = self._pools.get(key)
        if pool is None:
            tls = None
            if address.scheme == "https":
                self._tls = self._tls or ssl.create_default_context()
                tls = self._tls
            pool = EnginePool(
                address, self.settings.max_connections, self.settings.keepalive_expiry_s, tls
            )
            self._pools[key] = pool
        return pool

    def _address(self, url: str) -> EngineAddress:
        address = self._addresses.get(url)
        if address is None:
            address = self._addresses[url] = EngineAddress.parse(url)
        return address

    async def post(
        self, url: str, body: dict[str, Any], stream: bool, timeout: LegTimeout
    ) -> LegResponse:
        """The engine's answer; a 200 stream comes back open, anything else read whole."""
        if not self._opened:
            raise RuntimeError("LegClient.open() was not awaited")
        if self._closed:
            raise LegTransportError("unreachable", "the router is shutting down", False)
        deadline, connect_s = None, timeout.connect_s
        if timeout.whole_s is not None:  # the whole leg, connecting included
            deadline = asyncio.get_running_loop().time() + timeout.whole_s
            connect_s = min(connect_s, timeout.whole_s)
        address = self._address(url)
        pool = self._pool(address)
        data = json.dumps(body).encode()
        request = b"".join(
            (
                f"POST {address.path} HTTP/1.1\r\nHost: {address.host_header}\r\n".encode(),
                self._headers,
                b"Content-Length: %d\r\n\r\n" % len(data),
                data,
            )
        )
        try:
            connection = await pool.acquire(connect_s)
        except LEG_FAILURES as exc:
            raise transport_error(exc, delivered=False) from exc
        exchange = Exchange(pool, connection)
        try:
            connection.begin(request, timeout.read_s, deadline)
            await connection.wait_headers()
        except LEG_FAILURES as exc:
            exchange.close()
            raise transport_error(exc, delivered=True) from exc
        except BaseException:
            exchange.close()
            raise
        status, content_type = connection.status, connection.content_type
        if stream and status == 200:
            return LegResponse(status, content_type, exchange=exchange)
        try:
            payload = await exchange.read_all()
        finally:
            exchange.close()
        return LegResponse(status, content_type, payload)
