"""The HTTP client of the legs: one aiohttp session (C HTTP parser, no cookie jar) whose pool
holds up to ``max_connections`` kept-alive connections per engine.

Measured with py-spy under 32 concurrent requests, httpx's request machinery (anyio, h11,
cookie extraction) took most of the router's own CPU; the legs are the hot path, so they go
through aiohttp, while probes and model lists keep httpx. Every failure surfaces as
:class:`LegTransportError` saying whether the engine may have received the request.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_hybrid_nixl.router.settings import RouterSettings

JSON_HEADERS = {"Content-Type": "application/json"}


class LegTransportError(Exception):
    """A leg's HTTP exchange failed: ``kind`` is ``timeout`` or ``unreachable``;
    ``delivered`` says whether the engine may have received the request."""

    def __init__(self, kind: str, detail: str, delivered: bool) -> None:
        super().__init__(detail)
        self.kind, self.detail, self.delivered = kind, detail, delivered


def transport_error(exc: BaseException) -> LegTransportError:
    """What ``exc`` (raised by aiohttp while sending or reading a leg) means for the leg."""
    name = type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # no connection was made in time
        return LegTransportError("timeout", f"timed out ({name})", delivered=False)
    if isinstance(exc, asyncio.TimeoutError):
        return LegTransportError("timeout", f"timed out ({name})", delivered=True)
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, no route
        return LegTransportError("unreachable", f"engine unreachable: {exc!r}", delivered=False)
    return LegTransportError("unreachable", f"engine unreachable: {exc!r}", delivered=True)


LEG_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass
class LegResponse:
    """An engine's answer: status and content type; the whole body, or (a 200 stream) the
    open response to read with :meth:`next_chunk` and end with :meth:`close`."""

    status: int
    content_type: str
    body: bytes = b""
    stream: aiohttp.ClientResponse | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    async def next_chunk(self) -> bytes:
        """The stream's next bytes as they arrive, ``b""`` at its end (one await per chunk: the
        relay calls this for every token); raises :class:`LegTransportError` if it breaks."""
        if self.stream is None:
            return b""
        try:
            return await self.stream.content.readany()
        except LEG_FAILURES as exc:
            raise transport_error(exc) from exc

    def close(self) -> None:
        """Ends the stream: a finished one returns its connection to the pool, an unfinished
        one closes it (the engine aborts the request on the disconnect)."""
        if self.stream is None:
            return
        if self.stream.content.at_eof():
            self.stream.release()
        else:
            self.stream.close()


class LegClient:
    """POSTs the legs' JSON bodies to engines over pooled connections; opened and closed in
    the router's event loop (:meth:`open`, :meth:`aclose`)."""

    def __init__(self, settings: RouterSettings, headers: dict[str, str]) -> None:
        self.settings, self.headers = settings, {**headers, **JSON_HEADERS}
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> LegClient:
        connector = aiohttp.TCPConnector(
            limit=0,  # no overall cap: the cap is per engine
            limit_per_host=self.settings.max_connections,
            # well below the engines' keep-alive (see deploy/keepalive.py)
            keepalive_timeout=self.settings.keepalive_expiry_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), headers=self.headers
        )
        return self

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def timeout(self, read_s: float, whole_s: float | None = None) -> aiohttp.ClientTimeout:
        """``connect``: to get a connection (pool wait included); ``read_s``: between bytes."""
        return aiohttp.ClientTimeout(
            total=whole_s, connect=self.settings.connect_timeout_s, sock_read=read_s
        )

    async def post(
        self, url: str, body: dict[str, Any], stream: bool, timeout: aiohttp.ClientTimeout
    ) -> LegResponse:
        """The engine's answer; a 200 stream comes back open, anything else read whole."""
        if self._session is None:
            raise RuntimeError("LegClient.open() was not awaited")
        data = json.dumps(body).encode()
        try:
            response = await self._session.post(url, data=data, timeout=timeout)
        except LEG_FAILURES as exc:
            raise transport_error(exc) from exc
        content_type = response.headers.get("Content-Type", "application/json")
        if stream and response.status == 200:
            return LegResponse(response.status, content_type, stream=response)
        try:
            payload = await response.read()
        except LEG_FAILURES as exc:
            response.close()
            raise transport_error(exc) from exc
        response.release()
        return LegResponse(response.status, content_type, payload)
