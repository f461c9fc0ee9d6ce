"""Limits on what a client may send and how slowly: body size, body time, header time."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from vllm_hybrid_nixl.router.head_coalescing import head_coalescing_protocol

logger = logging.getLogger("vllm_hybrid_nixl.router")

#: Deepest JSON nesting a request may have (OpenAI bodies, tool schemas included, stay far
#: below); deeper bodies are refused before any engine sees them.
MAX_JSON_DEPTH = 64


T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``awaitable``'s result, or the builtin TimeoutError after ``timeout_s``. On Python
    3.11+ it runs in the caller's task (:func:`within_task`): no task of its own, so no
    extra turn of the event loop on the request path; on 3.10, :func:`within_wait_for`."""
    if sys.version_info >= (3, 11):
        return await within_task(awaitable, timeout_s)
    return await within_wait_for(awaitable, timeout_s)


async def within_task(awaitable: Awaitable[T], timeout_s: float) -> T:
    """:func:`within` in the caller's task (``asyncio.timeout``, Python 3.11+)."""
    async with asyncio.timeout(timeout_s):  # type: ignore[attr-defined]
        return await awaitable


async def within_wait_for(awaitable: Awaitable[T], timeout_s: float) -> T:
    """:func:`within` through ``asyncio.wait_for`` (any Python), whose timeout is not the
    builtin TimeoutError before 3.11."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError as exc:
        raise TimeoutError from exc


class BodyRejected(Exception):
    """The body was too large or too slow; ``status`` is 413 or 408."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, refused early when its declared or actual size exceeds
    ``max_bytes`` or when it has not fully arrived within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyRejected(
            413, f"request body is {declared} bytes; this router accepts at most {max_bytes}"
        )

    received = [0]  # bytes so far, for the operator's log line on a timeout

    async def collect() -> bytes:
        chunks: list[bytes] = []
        async for chunk in request.stream():
            received[0] += len(chunk)
            if received[0] > max_bytes:
                raise BodyRejected(
                    413, f"request body exceeds {max_bytes} bytes, the most this router accepts"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await within(collect(), timeout_s)
    except TimeoutError:
        client = request.client
        logger.warning(
            "408: %d of %s body bytes from %s arrived within %g s (a slow client, or packets "
            "held up between it and the router)",
            received[0],
            declared if declared is not None else "an undeclared number of",
            f"{client.host}:{client.port}" if client else "an unknown client",
            timeout_s,
        )
        raise BodyRejected(
            408, f"request body did not arrive within {timeout_s:g} s; send it faster"
        ) from None


def header_deadline_protocol(base: type, header_timeout_s: float) -> type:
    """A uvicorn HTTP protocol class that closes a connection whose request headers do not
    arrive within ``header_timeout_s`` (slow-loris clients).

    uvicorn bounds idle keep-alive connections but not a client dribbling header bytes. The
    deadline is armed when the connection opens and, on a kept-alive connection, at the
    first byte of the next request (idleness between requests is the keep-alive timeout's
    job: a deadline armed at the response would close idle connections early and race
    clients reusing them); it is disarmed once the headers are complete (``cycle`` is
    replaced).
    """

    class HeaderDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def _arm(self) -> None:
            self._disarm()
            self._cycle_when_armed = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            deadline = getattr(self, "_deadline", None)
            if deadline is not None:
                deadline.cancel()
                self._deadline = None

        def _between_requests(self) -> bool:
            """No request is being served: none yet, or the last one answered."""
            return self.cycle is None or self.cycle.response_complete

        def _expire(self) -> None:
            self._deadline = None
            if (
                self.cycle is self._cycle_when_armed
                and self._between_requests()  # never cut a request being served
                and not self.transport.is_closing()
            ):
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if getattr(self, "_idle_after_response", False):
                self._idle_after_response = False
                self._arm()  # the next request's first bytes: its headers are now due
            super().data_received(data)
            if getattr(self, "_deadline", None) is not None and (
                self.cycle is not self._cycle_when_armed
            ):
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            self._idle_after_response = not self.transport.is_closing() and self._between_requests()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderDeadlineProtocol.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol


def uvicorn_http_protocol(header_timeout_s: float) -> type:
    """uvicorn's fastest available HTTP protocol, with the header deadline, writing a
    response's head together with its first body bytes (:mod:`.head_coalescing`)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools not installed
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return header_deadline_protocol(head_coalescing_protocol(base), header_timeout_s)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counted without recursion, up to ``limit + 1``.
    Only containers are visited: a prompt of token ids is one level, not a walk per id."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def nested_too_deep(raw: bytes, body: Any, limit: int) -> bool:
    """Whether the body nests deeper than ``limit``. A body with at most ``limit`` brackets
    cannot (counted in C, strings included), so most bodies are never walked."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return json_depth(body, limit) > limit
