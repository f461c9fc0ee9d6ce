"""``/v1/completions`` and ``/v1/chat/completions``: read and check the body, run the two legs
(``proxy.Disaggregator``), and answer: the decode engine's body, its stream relayed chunk by
chunk (a stream that breaks ends with an error event, never silently), or a clear error. A
client that goes away aborts its legs."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing, suppress
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from vllm_hybrid_nixl.router.backends import NoCompatiblePairError
from vllm_hybrid_nixl.router.fanout import Part, merge_bodies, merged_events, split_request
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.leg_http import LegTransportError
from vllm_hybrid_nixl.router.limits import MAX_JSON_DEPTH, BodyRejected, nested_too_deep, read_body
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.models import ServedModels
from vllm_hybrid_nixl.router.proxy import DecodeAnswer, Disaggregator, LegError, NoEngineError
from vllm_hybrid_nixl.router.responses import error_response, leg_error_response, stream_error_event
from vllm_hybrid_nixl.router.settings import RouterSettings
from vllm_hybrid_nixl.router.validation import request_problem

logger = logging.getLogger("vllm_hybrid_nixl.router")

T = TypeVar("T")


class BadRequest(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("bad request")
        self.response = response


async def until_disconnected(receive: Any) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def client_left_first(work: asyncio.Future[Any], receive: Any) -> bool:
    """Wait for ``work`` or the client's disconnect, whichever comes first; True when the
    client left while ``work`` was still running (``work`` is left to the caller)."""
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return not work.done()


class ClientLeft(Exception):
    """The client closed its connection while :func:`unless_client_leaves` ran its work."""


async def unless_client_leaves(work: Awaitable[T], receive: Any) -> T:
    """``work``'s result, awaited in the caller's own task (no task of its own, so no turns
    of the event loop to start it and to hear it finished); a watcher cancels it if the
    client disconnects first, and then :class:`ClientLeft` is raised. A cancel that is not
    the watcher's (the server stopping) propagates as usual."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("unless_client_leaves needs a running task")
    left = False

    async def watch() -> None:
        nonlocal left
        await until_disconnected(receive)
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        if sys.version_info >= (3, 11) and task.uncancel() > 0:
            raise  # the server is stopping too: its cancel goes on
        raise ClientLeft from None
    finally:
        watcher.cancel()


class RelayedStream:
    """The decode engine's stream as an ASGI response, relayed chunk by chunk straight to
    the server's ``send``: the relay is the router's hottest loop (one pass per token of
    every stream), so nothing else runs per chunk. A client that leaves, before the relay began or
    during it, cancels the relay: the engine connection is closed (the engine aborts the
    request) and the leg's in-flight count returned (least-in-flight routing reads it). A
    stream that breaks ends with an error event, never silently."""

    def __init__(
        self,
        answer: DecodeAnswer,
        request_id: str,
        handler: CompletionHandler,
        finish: Callable[[str], None],
    ) -> None:
        self.answer, self.request_id, self.handler = answer, request_id, handler
        self.finish = finish
        self.outcome = "ok"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relay: asyncio.Future[None] | None = None
        try:
            # The headers and the first event go out from this task, before the relay task
            # exists: the first token reaches the client without another turn of the loop.
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            first = self.answer.first
            await send({"type": "http.response.body", "body": first, "more_body": True})
            relay = asyncio.ensure_future(self.relay(send))
            await client_left_first(relay, receive)
        except asyncio.CancelledError:  # the server is stopping, or the client left
            self.outcome = "client_disconnected"
            raise
        except Exception:  # the server failed to send: not the client's leaving
            self.outcome = "router_error"
            raise
        finally:
            if relay is not None and not relay.done():  # the client left mid-stream
                relay.cancel()
                self.outcome = "client_disconnected"
            try:
                if relay is not None:
                    with suppress(asyncio.CancelledError):
                        await relay
            except Exception:  # a send failed mid-stream: the router's fault, not the client's
                self.outcome = "router_error"
                raise
            finally:  # also when the relay was cancelled before it ran at all
                if self.outcome == "client_disconnected":
                    self.handler.metrics.client_disconnects.inc()
                self.answer.response.close()  # an unfinished stream: the engine aborts it
                self.handler.proxy.leg_ended(self.answer.decode)
                self.finish(self.outcome)

    async def relay(self, send: Any) -> None:
        """What follows the first event (``__call__`` sent it), chunk by chunk."""
        answer = self.answer
        try:
            read = answer.response.next_chunk
            while chunk := await read():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except LegTransportError as exc:
            self.outcome = "decode_stream_broken"
            self.handler.health.record_failure(answer.decode, f"stream broke: {exc.detail}")
            logger.warning(
                "request %s: decode stream from %s broke: %s",
                self.request_id,
                answer.decode.url,
                exc.detail,
            )
            cause = type(exc.__cause__ or exc).__name__
            event = stream_error_event(
                f"decode leg failed on engine {answer.decode.label} while streaming: "
                f"{cause}; the answer is incomplete (request id {self.request_id})"
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class FanOutStream:
    """The parts' decode streams merged into one ASGI stream (:mod:`.fanout`); a client that
    leaves closes every part's stream (the engines abort them)."""

    def __init__(
        self,
        parts: list[Part],
        answers: list[DecodeAnswer],
        handler: CompletionHandler,
        finish: Callable[[str], None],
    ) -> None:
        self.parts, self.answers, self.handler, self.finish = parts, answers, handler, finish
        self.outcome = "ok"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relay = asyncio.ensure_future(self.relay(send))
        try:
            await client_left_first(relay, receive)
        finally:
            if not relay.done():
                relay.cancel()
                self.outcome = "client_disconnected"
                self.handler.metrics.client_disconnects.inc()
            try:
                with suppress(asyncio.CancelledError):
                    await relay
            except Exception:  # a send failed mid-stream: the router's fault, not the client's
                self.outcome = "router_error"
                raise
            finally:
                for answer in self.answers:
                    answer.response.close()
                    self.handler.proxy.leg_ended(answer.decode)
                self.finish(self.outcome)

    async def relay(self, send: Any) -> None:
        firsts = [a.first for a in self.answers]
        readers = [a.response.next_chunk for a in self.answers]
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:  # closed even when a send fails: its readers stop before the streams close
            async with aclosing(merged_events(self.parts, firsts, readers)) as events:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except LegTransportError as exc:
            self.outcome = "decode_stream_broken"
            logger.warning("a decode stream of a batched request broke: %s", exc.detail)
            event = stream_error_event(
                f"a decode leg failed while streaming: {type(exc.__cause__ or exc).__name__}; "
                "the answer is incomplete"
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class CompletionHandler:
    """One handler for both OpenAI completion routes."""

    def __init__(
        self,
        proxy: Disaggregator,
        health: HealthTracker,
        metrics: RouterMetrics,
        models: ServedModels,
        settings: RouterSettings,
    ) -> None:
        self.proxy, self.health, self.metrics = proxy, health, metrics
        self.models, self.settings = models, settings

    async def handle(
        self, path: str, endpoint: str, request: Request
    ) -> Response | RelayedStream | FanOutStream:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"router-{secrets.token_hex(8)}"
        try:
            body = await self.checked_body(endpoint, request)
        except BadRequest as exc:
            self.metrics.child(self.metrics.requests, endpoint, "bad_request").inc()
            return exc.response
        except ClientDisconnect:  # gone before its body had arrived: nothing to answer
            self.metrics.child(self.metrics.requests, endpoint, "client_disconnected").inc()
            self.metrics.client_disconnects.inc()
            return Response(status_code=499)

        def finish(outcome: str) -> None:
            self.metrics.child(self.metrics.requests, endpoint, outcome).inc()
            self.metrics.child(self.metrics.request_seconds, endpoint).observe(
                time.perf_counter() - started
            )
            self.metrics.in_flight.dec()

        self.metrics.in_flight.inc()
        parts = split_request(endpoint, body)
        if parts is not None:
            stream = bool(body.get("stream"))
            return await self.handle_parts(path, parts, stream, request, request_id, finish)
        try:  # the legs are cancelled (engines abort them) if the client leaves
            answer = await unless_client_leaves(self.proxy.run(path, body), request.receive)
        except ClientLeft:
            self.metrics.client_disconnects.inc()
            finish("client_disconnected")
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - each kind is answered in failed()
            return self.failed(exc, request_id, finish)
        if not body.get("stream"):
            finish("ok")
            return Response(
                answer.response.body, status_code=200, media_type=answer.response.content_type
            )
        return RelayedStream(answer, request_id, self, finish)

    async def handle_parts(
        self,
        path: str,
        parts: list[Part],
        stream: bool,
        request: Request,
        request_id: str,
        finish: Callable[[str], None],
    ) -> Response | FanOutStream:
        """A batch or ``n > 1``: one P/D request per part, answered as one response."""
        runs = [asyncio.ensure_future(self.proxy.run(path, part.body)) for part in parts]
        all_runs = asyncio.ensure_future(asyncio.gather(*runs))
        left = await client_left_first(all_runs, request.receive)
        if left or all_runs.exception() is not None:
            for run in runs:
                run.cancel()
            with suppress(BaseException):
                await all_runs
            answered = [
                r.result() for r in runs if r.done() and not r.cancelled() and not r.exception()
            ]
            for answer in answered:
                if stream:
                    answer.response.close()
                    self.proxy.leg_ended(answer.decode)
            if left:
                self.metrics.client_disconnects.inc()
                finish("client_disconnected")
                return Response(status_code=499)
            failure = next(
                r.exception() for r in runs if r.done() and not r.cancelled() and r.exception()
            )
            return self.failed(failure, request_id, finish)
        answers = all_runs.result()
        if not stream:
            merged = merge_bodies(parts, [a.response.body for a in answers])
            finish("ok")
            return Response(merged, status_code=200, media_type="application/json")
        return FanOutStream(parts, answers, self, finish)

    async def checked_body(self, endpoint: str, request: Request) -> Any:
        """The parsed body, or BadRequest carrying the 4xx to send."""
        too_deep = False
        try:
            raw = await read_body(
                request, self.settings.max_body_bytes, self.settings.body_timeout_s
            )
            body = json.loads(raw)
        except BodyRejected as exc:
            raise BadRequest(
                error_response(exc.status, exc.message, "invalid_request_error")
            ) from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            message = f"request body is not valid JSON ({exc})"
            raise BadRequest(error_response(400, message, "invalid_request_error")) from exc
        except RecursionError:
            too_deep = True  # deeper than Python's parser goes
        if too_deep or nested_too_deep(raw, body, MAX_JSON_DEPTH):
            message = f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels; flatten it"
            raise BadRequest(error_response(400, message, "invalid_request_error"))
        wanted = body.get("model") if isinstance(body, dict) else None
        names, max_model_len = await self.models.facts(self.proxy.client, wanted)
        problem = request_problem(endpoint, body, self.settings, names, max_model_len)
        if problem is not None:
            raise BadRequest(
                error_response(problem.status, problem.message, problem.kind, param=problem.param)
            )
        return body

    def failed(self, exc: Exception, request_id: str, finish: Callable[[str], None]) -> Response:
        """The answer to legs that ended in ``exc``."""
        if isinstance(exc, LegError):
            finish(f"{exc.leg}_error")
            return leg_error_response(exc, request_id)
        if isinstance(exc, NoCompatiblePairError):
            finish("incompatible_engines")
            logger.error("request %s: %s", request_id, exc)
            return error_response(
                503, str(exc), "incompatible_engines", reasons=exc.reasons, request_id=request_id
            )
        if isinstance(exc, NoEngineError):
            finish(f"no_{exc.leg}_engine")
            logger.warning("request %s: %s", request_id, exc)
            return error_response(
                503, exc.public_message, "service_unavailable", leg=exc.leg, request_id=request_id
            )
        finish("router_error")
        logger.error("request %s: the router failed to serve it", request_id, exc_info=exc)
        return error_response(
            500,
            f"the router could not serve this request (request id {request_id}; the "
            "router's log has the cause)",
            "router_error",
            request_id=request_id,
        )
