"""The router's HTTP application (FastAPI + one pooled httpx client).

Each completion or chat request becomes two legs (``proxy.Disaggregator``): a prefill leg on a
prefill engine, then the original request plus the returned ``kv_transfer_params`` on a
decode engine, whose answer (streamed or not) goes straight back to the client. Engines are
probed in the background (``health.HealthTracker``); a client that goes away aborts its legs;
a stream that breaks ends with an error event, never silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_hybrid_nixl.router.auth import BearerAuthMiddleware
from vllm_hybrid_nixl.router.backends import Backend, BackendPool, NoCompatiblePairError
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.limits import BodyRejected, read_body
from vllm_hybrid_nixl.router.loop_lag import watch_loop_lag
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.proxy import (
    Disaggregator,
    LegError,
    NoEngineError,
    client_status,
    prefill_body,
    upstream_detail,
)
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings
from vllm_hybrid_nixl.router.validation import request_problem

__all__ = ["RouterKeys", "RouterSettings", "build_app", "prefill_body"]

logger = logging.getLogger("vllm_hybrid_nixl.router")
#: Deepest JSON nesting a request may have (OpenAI bodies, tool schemas included, stay far
#: below); deeper bodies are refused before any engine sees them.
MAX_JSON_DEPTH = 64
#: Seconds between full re-reads of every engine's layout by the background probes.
LAYOUT_REFRESH_S = 30.0


def error_response(status: int, message: str, error_type: str, **extra: Any) -> JSONResponse:
    """An OpenAI-style error body: message, type, code, and any ``extra`` fields."""
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "code": status, **extra}},
        status_code=status,
    )


def leg_error_response(error: LegError, request_id: str = "") -> JSONResponse:
    """A failed leg as the client sees it: the engine's own message, type and param for a
    request the engine judged; engines by name only (addresses go to the log)."""
    if request_id:
        logger.warning("request %s: %s", request_id, error.message)
    upstream = error.upstream if error.kind == "client_error" else {}
    return error_response(
        error.status,
        error.public_message,
        str(upstream.get("type") or "upstream_error"),
        param=upstream.get("param"),
        leg=error.leg,
        engine=error.backend.label,
        kind=error.kind,
        request_id=request_id or None,
    )


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


def stream_error_event(message: str) -> bytes:
    error = {"message": message, "type": "upstream_error", "code": 502}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(
    pool: BackendPool, settings: RouterSettings | None = None, keys: RouterKeys | None = None
) -> FastAPI:
    """The router for ``pool``; ``keys`` default to none (no client or engine key)."""
    settings = settings or RouterSettings()
    keys = keys or RouterKeys()
    metrics = RouterMetrics()
    pairing = PairingTable(pool.all(), timeout_s=settings.health_timeout_s)
    health = HealthTracker(
        pool.all(),
        probe_failures_to_eject=settings.probe_failures_to_eject,
        request_failures_to_open=settings.request_failures_to_open,
        open_cooldown_s=settings.open_cooldown_s,
    )
    proxy = Disaggregator(pool, pairing, health, metrics, settings)

    async def probe(client: httpx.AsyncClient, backend: Backend) -> None:
        # Through the engine's own leg pool: the probe also closes that pool's expired
        # connections (httpx prunes a pool only when it is used), so idle engine
        # connections go back to one per engine between bursts.
        client = proxy.leg_clients.get(backend.url, client)
        try:
            response = await client.get(f"{backend.url}/health", timeout=settings.health_timeout_s)
            ok, detail = response.status_code == 200, f"/health: HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, f"/health: {exc!r}"
        health.record_probe(backend, ok, "" if ok else detail)
        metrics.engine_up.labels(backend.url, backend.role).set(
            1 if health.state(backend).value == "up" else 0
        )

    layouts_read_at = time.monotonic()

    async def probe_all(client: httpx.AsyncClient) -> None:
        """Engine health, then layouts: those not known yet, those of engines that just came
        (back) up — a restarted engine may have another layout — and all of them every
        ``LAYOUT_REFRESH_S``. ``/health`` only reads what this cached."""
        nonlocal layouts_read_at
        was_up = {b.url for b in pool.all() if health.state(b).value == "up"}
        await asyncio.gather(*(probe(client, b) for b in pool.all()))
        came_up = [b for b in pool.all() if health.state(b).value == "up" and b.url not in was_up]
        if time.monotonic() - layouts_read_at >= LAYOUT_REFRESH_S:
            layouts_read_at = time.monotonic()
            await asyncio.to_thread(pairing.refresh)
        elif came_up:
            await asyncio.to_thread(pairing.refresh, False, came_up)
        elif pairing.needs_probe():
            await asyncio.to_thread(pairing.refresh, True)

    async def probe_forever(client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(settings.probe_interval_s)
            with suppress(Exception):  # a probe round must never end the loop
                await probe_all(client)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            # well below the engines' keep-alive (see keepalive.py)
            keepalive_expiry=settings.keepalive_expiry_s,
        )

        def new_client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                limits=limits, timeout=settings.prefill_timeout_s, headers=keys.engine_headers()
            )

        async with AsyncExitStack() as clients:
            client = await clients.enter_async_context(new_client())  # probes, model list
            # One pool per engine for the legs: httpx's pool scans all of its connections
            # for every request it places (28 % of the router's CPU under 64 concurrent
            # requests with one shared pool, measured with py-spy).
            proxy.client = client
            proxy.leg_clients = {
                b.url: await clients.enter_async_context(new_client()) for b in pool.all()
            }
            await probe_all(client)  # no leg goes to an engine not seen healthy
            watchers = [
                asyncio.create_task(probe_forever(client)),
                asyncio.create_task(watch_loop_lag(metrics.loop_lag)),
            ]
            try:
                yield
            finally:
                for task in watchers:
                    task.cancel()
                for task in watchers:
                    with suppress(asyncio.CancelledError):
                        await task

    app = FastAPI(title="vllm-hybrid-nixl router", lifespan=lifespan)
    if keys.api_key:
        app.add_middleware(
            BearerAuthMiddleware, api_key=keys.api_key, protect_probes=settings.protect_probes
        )
    models = ServedModels(pool, settings.health_timeout_s)
    app.state.metrics, app.state.pool, app.state.pairing = metrics, pool, pairing
    app.state.health = health

    async def disaggregate(path: str, endpoint: str, request: Request) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"router-{uuid.uuid4().hex[:16]}"
        too_deep = False
        try:
            raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
            body = json.loads(raw)
        except BodyRejected as exc:
            metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(exc.status, exc.message, "invalid_request_error")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(
                400, f"request body is not valid JSON ({exc})", "invalid_request_error"
            )
        except RecursionError:
            too_deep = True  # deeper than Python's parser goes
        if too_deep or nested_too_deep(raw, body, MAX_JSON_DEPTH):
            metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(
                400,
                f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels; flatten it",
                "invalid_request_error",
            )
        wanted = body.get("model") if isinstance(body, dict) else None
        names, max_model_len = await models.facts(proxy.client, wanted)
        problem = request_problem(endpoint, body, settings, names, max_model_len)
        if problem is not None:
            metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(
                problem.status, problem.message, problem.kind, param=problem.param
            )

        def finish(outcome: str) -> None:
            metrics.requests.labels(endpoint, outcome).inc()
            metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)
            metrics.in_flight.dec()

        metrics.in_flight.inc()
        legs = asyncio.create_task(proxy.run(path, body))
        gone = asyncio.create_task(until_disconnected(request))
        try:
            await asyncio.wait({legs, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not legs.done():  # the client left: abort the legs (engines abort on disconnect)
            legs.cancel()
            with suppress(BaseException):
                await legs
            metrics.client_disconnects.inc()
            finish("client_disconnected")
            return Response(status_code=499)
        try:
            answer = legs.result()
        except LegError as exc:
            finish(f"{exc.leg}_error")
            return leg_error_response(exc, request_id)
        except NoCompatiblePairError as exc:
            finish("incompatible_engines")
            logger.error("request %s: %s", request_id, exc)
            return error_response(
                503, str(exc), "incompatible_engines", reasons=exc.reasons, request_id=request_id
            )
        except NoEngineError as exc:
            finish(f"no_{exc.leg}_engine")
            logger.warning("request %s: %s", request_id, exc)
            return error_response(
                503, exc.public_message, "service_unavailable", leg=exc.leg, request_id=request_id
            )
        except Exception:
            finish("router_error")
            logger.exception("request %s: the router failed to serve it", request_id)
            return error_response(
                500,
                f"the router could not serve this request (request id {request_id}; the "
                "router's log has the cause)",
                "router_error",
                request_id=request_id,
            )

        if not body.get("stream"):
            finish("ok")
            return Response(
                answer.response.content,
                status_code=200,
                media_type=answer.response.headers.get("content-type", "application/json"),
            )

        async def relay():
            outcome = "ok"
            try:
                yield answer.first
                async for chunk in answer.rest:
                    yield chunk
            except httpx.HTTPError as exc:
                outcome = "decode_stream_broken"
                health.record_failure(answer.decode, f"stream broke: {exc!r}")
                logger.warning(
                    "request %s: decode stream from %s broke: %r",
                    request_id,
                    answer.decode.url,
                    exc,
                )
                yield stream_error_event(
                    f"decode leg failed on engine {answer.decode.label} while streaming: "
                    f"{type(exc).__name__}; the answer is incomplete (request id {request_id})"
                )
            except asyncio.CancelledError:
                outcome = "client_disconnected"
                metrics.client_disconnects.inc()
                raise
            finally:
                await answer.response.aclose()  # closing the stream aborts it on the engine
                proxy.leg_ended(answer.decode)
                finish(outcome)

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await disaggregate("/v1/completions", "completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await disaggregate("/v1/chat/completions", "chat", request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        backend = next(
            (b for b in [*pool.decode, *pool.prefill] if health.usable(b)),
            pool.decode[0] if pool.decode else pool.prefill[0],
        )
        try:
            response = await proxy.client.get(
                f"{backend.url}/v1/models", timeout=settings.health_timeout_s
            )
        except httpx.HTTPError as exc:
            return leg_error_response(
                LegError("models", backend, 502, f"engine unreachable: {exc!r}", "unreachable")
            )
        if response.status_code != 200:
            return leg_error_response(
                LegError(
                    "models",
                    backend,
                    client_status(response.status_code),
                    upstream_detail(response),
                    "engine_error",
                )
            )
        return Response(response.content, status_code=200, media_type="application/json")

    @app.get("/health")
    async def router_health() -> JSONResponse:
        engines = [
            {
                "name": b.label,
                "role": b.role,
                "url": b.url,
                **health.snapshot(b),
                "layout": pairing.layout(b).summary(),
            }
            for b in pool.all()
        ]
        up = {e["url"] for e in engines if e["up"]}
        pairable = [
            (p, d)
            for p in pool.prefill
            for d in pool.decode
            if p.url in up and d.url in up and not pairing.problem(p, d)
        ]
        return JSONResponse(
            {
                "status": "ok" if pairable else "unavailable",
                "engines": engines,
                "pairing_problems": pairing.problems(pool.prefill, pool.decode),
            },
            status_code=200 if pairable else 503,
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class ServedModels:
    """Model names (and context length) the engines serve, learned from ``/v1/models``.

    Asked again when a request names a model not seen yet (at most every ``refresh_s``), so
    the router can answer 404 for an unknown model without forwarding the request."""

    def __init__(
        self,
        pool: BackendPool,
        timeout_s: float,
        refresh_s: float = 10.0,
    ) -> None:
        self._pool, self._timeout_s, self._refresh_s = pool, timeout_s, refresh_s
        self._names: frozenset[str] = frozenset()
        self._max_model_len: int | None = None
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()

    async def facts(
        self, client: httpx.AsyncClient, wanted: str | None
    ) -> tuple[frozenset[str], int | None]:
        """Served names and context length; ``client`` is the router's pooled one (it carries
        the engine key)."""
        stale = time.monotonic() - self._fetched_at > self._refresh_s
        if stale and (not self._names or (wanted is not None and wanted not in self._names)):
            async with self._lock:
                if time.monotonic() - self._fetched_at > self._refresh_s:
                    await self._fetch(client)
        return self._names, self._max_model_len

    async def _fetch(self, client: httpx.AsyncClient) -> None:
        self._fetched_at = time.monotonic()
        for backend in [*self._pool.decode, *self._pool.prefill]:
            try:
                response = await client.get(f"{backend.url}/v1/models", timeout=self._timeout_s)
                cards = response.json().get("data", []) if response.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            names = frozenset(c["id"] for c in cards if isinstance(c, dict) and "id" in c)
            if names:
                lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
                self._names = names
                self._max_model_len = min((n for n in lengths if isinstance(n, int)), default=None)
                return
