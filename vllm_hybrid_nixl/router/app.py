"""The router's HTTP application (FastAPI + one pooled httpx client).

Each completion or chat request becomes two legs: a prefill leg (``max_tokens=1``, not
streamed, ``kv_transfer_params={"do_remote_decode": true}``) on a prefill engine, then the
original request plus the returned ``kv_transfer_params`` on a decode engine, whose answer
(streamed or not) goes straight back to the client.  A failing leg becomes an OpenAI-style
error naming the leg and the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from vllm_hybrid_nixl.router.auth import BearerAuthMiddleware
from vllm_hybrid_nixl.router.backends import Backend, BackendPool, NoCompatiblePairError
from vllm_hybrid_nixl.router.limits import BodyRejected, read_body
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings
from vllm_hybrid_nixl.router.validation import request_problem

__all__ = ["RouterKeys", "RouterSettings", "build_app"]


class LegError(Exception):
    """A leg that did not produce a usable answer; carries the client-facing status."""

    def __init__(self, leg: str, backend: Backend, status: int, detail: str) -> None:
        super().__init__(detail)
        self.leg, self.backend, self.status, self.detail = leg, backend, status, detail

    def response(self) -> JSONResponse:
        message = (
            f"{self.leg} leg failed on engine {self.backend.label} ({self.backend.url}): "
            f"{self.detail}"
        )
        return error_response(
            self.status, message, "upstream_error", leg=self.leg, engine=self.backend.url
        )


def error_response(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status, **extra}}, status_code=status
    )


def _upstream_detail(response: httpx.Response) -> str:
    try:
        payload = response.json()
        message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
        if message is None and isinstance(payload, dict):
            message = payload.get("message") or payload.get("detail")
        text = str(message if message is not None else payload)
    except (json.JSONDecodeError, ValueError):
        text = response.text
    return f"HTTP {response.status_code}: {text[:500]}"


def _client_status(upstream_status: int) -> int:
    """Client errors pass through (the request is at fault); engine errors become 502."""
    return upstream_status if 400 <= upstream_status < 500 else 502


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "n" in leg:
        leg["n"] = 1
    return leg


def build_app(
    pool: BackendPool, settings: RouterSettings | None = None, keys: RouterKeys | None = None
) -> FastAPI:
    """The router for ``pool``; ``keys`` default to none (no client or engine key)."""
    settings = settings or RouterSettings()
    keys = keys or RouterKeys()
    metrics = RouterMetrics()
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            # vLLM's server (uvicorn) closes idle connections after 5 s; httpx's default
            # expiry is also 5 s, so a pooled connection could be reused just as the engine
            # closes it (seen here: "engine unreachable: ReadError" on a prefill leg).
            keepalive_expiry=settings.keepalive_expiry_s,
        )
        async with httpx.AsyncClient(
            limits=limits, timeout=settings.prefill_timeout_s, headers=keys.engine_headers()
        ) as client:
            state["client"] = client
            yield

    app = FastAPI(title="vllm-hybrid-nixl router", lifespan=lifespan)
    if keys.api_key:
        app.add_middleware(
            BearerAuthMiddleware, api_key=keys.api_key, protect_probes=settings.protect_probes
        )
    models = ServedModels(pool, settings.health_timeout_s, keys.engine_headers())
    app.state.metrics = metrics
    app.state.pool = pool
    pairing = PairingTable(pool.all(), timeout_s=settings.health_timeout_s)
    app.state.pairing = pairing

    async def send_leg(
        leg: str, backend: Backend, path: str, body: dict[str, Any], stream: bool
    ) -> httpx.Response:
        client = state["client"]
        timeout = httpx.Timeout(
            settings.prefill_timeout_s if leg == "prefill" else settings.decode_read_timeout_s,
            connect=settings.connect_timeout_s,
        )
        request = client.build_request("POST", f"{backend.url}{path}", json=body, timeout=timeout)
        started = time.perf_counter()
        try:
            response = await client.send(request, stream=stream)
        except httpx.TimeoutException as exc:
            metrics.leg_requests.labels(leg, backend.url, "timeout").inc()
            raise LegError(leg, backend, 504, f"timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            metrics.leg_requests.labels(leg, backend.url, "unreachable").inc()
            raise LegError(leg, backend, 502, f"engine unreachable: {exc!r}") from exc
        metrics.leg_seconds.labels(leg).observe(time.perf_counter() - started)
        if response.status_code != 200:
            if stream:
                await response.aread()
                await response.aclose()
            metrics.leg_requests.labels(leg, backend.url, f"http_{response.status_code}").inc()
            raise LegError(
                leg, backend, _client_status(response.status_code), _upstream_detail(response)
            )
        metrics.leg_requests.labels(leg, backend.url, "ok").inc()
        return response

    async def disaggregate(path: str, endpoint: str, request: Request) -> Response:
        started = time.perf_counter()
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
        names, max_model_len = await models.facts(
            body.get("model") if isinstance(body, dict) else None
        )
        problem = request_problem(endpoint, body, settings, names, max_model_len)
        if problem is not None:
            metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(
                problem.status, problem.message, problem.kind, param=problem.param
            )
        metrics.in_flight.inc()
        try:
            if pairing.needs_probe():
                await asyncio.to_thread(pairing.refresh, True)
            prefill, decode = pool.next_pair(pairing.problem)
            first = await send_leg("prefill", prefill, path, prefill_body(body), stream=False)
            params = first.json().get("kv_transfer_params")
            if not params:
                raise LegError(
                    "prefill",
                    prefill,
                    502,
                    "the engine returned no kv_transfer_params; is it running with "
                    "--kv-transfer-config and kv_role kv_producer?",
                )
            decode_body = {**body, "kv_transfer_params": params}
            stream = bool(body.get("stream"))
            second = await send_leg("decode", decode, path, decode_body, stream=stream)
        except LegError as exc:
            metrics.requests.labels(endpoint, f"{exc.leg}_error").inc()
            metrics.in_flight.dec()
            return exc.response()
        except NoCompatiblePairError as exc:
            metrics.requests.labels(endpoint, "incompatible_engines").inc()
            metrics.in_flight.dec()
            return error_response(503, str(exc), "incompatible_engines", reasons=exc.reasons)
        except LookupError as exc:
            metrics.in_flight.dec()
            return error_response(503, str(exc), "service_unavailable")

        def finish(outcome: str = "ok") -> None:
            metrics.requests.labels(endpoint, outcome).inc()
            metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)
            metrics.in_flight.dec()

        if not stream:
            finish()
            return Response(
                second.content,
                status_code=200,
                media_type=second.headers.get("content-type", "application/json"),
            )

        async def relay():
            async for chunk in second.aiter_raw():
                yield chunk

        async def close() -> None:
            await second.aclose()
            finish()

        return StreamingResponse(
            relay(), media_type="text/event-stream", background=BackgroundTask(close)
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await disaggregate("/v1/completions", "completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await disaggregate("/v1/chat/completions", "chat", request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        backend = pool.decode[0] if pool.decode else pool.prefill[0]
        try:
            response = await state["client"].get(
                f"{backend.url}/v1/models", timeout=settings.health_timeout_s
            )
        except httpx.HTTPError as exc:
            return LegError("models", backend, 502, f"engine unreachable: {exc!r}").response()
        if response.status_code != 200:
            return LegError(
                "models", backend, _client_status(response.status_code), _upstream_detail(response)
            ).response()
        return Response(response.content, status_code=200, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        async def probe(backend: Backend) -> dict[str, Any]:
            try:
                response = await state["client"].get(
                    f"{backend.url}/health", timeout=settings.health_timeout_s
                )
                up = response.status_code == 200
                detail = "" if up else f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                up, detail = False, repr(exc)
            return {
                "name": backend.label,
                "role": backend.role,
                "url": backend.url,
                "up": up,
                "detail": detail,
                "layout": pairing.layout(backend).summary(),
            }

        await asyncio.to_thread(pairing.refresh)
        engines = await asyncio.gather(*(probe(b) for b in pool.all()))
        up = {e["url"] for e in engines if e["up"]}
        pairable = [
            (p, d)
            for p in pool.prefill
            for d in pool.decode
            if p.url in up and d.url in up and not pairing.problem(p, d)
        ]
        problems = pairing.problems(pool.prefill, pool.decode)
        return JSONResponse(
            {
                "status": "ok" if pairable else "unavailable",
                "engines": engines,
                "pairing_problems": problems,
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
        headers: dict[str, str],
        refresh_s: float = 10.0,
    ) -> None:
        self._pool, self._timeout_s, self._refresh_s = pool, timeout_s, refresh_s
        self._headers = headers
        self._names: frozenset[str] = frozenset()
        self._max_model_len: int | None = None
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()

    async def facts(self, wanted: str | None) -> tuple[frozenset[str], int | None]:
        stale = time.monotonic() - self._fetched_at > self._refresh_s
        if stale and (not self._names or (wanted is not None and wanted not in self._names)):
            async with self._lock:
                if time.monotonic() - self._fetched_at > self._refresh_s:
                    await self._fetch()
        return self._names, self._max_model_len

    async def _fetch(self) -> None:
        self._fetched_at = time.monotonic()
        async with httpx.AsyncClient(timeout=self._timeout_s, headers=self._headers) as client:
            for backend in [*self._pool.decode, *self._pool.prefill]:
                try:
                    response = await client.get(f"{backend.url}/v1/models")
                    cards = response.json().get("data", []) if response.status_code == 200 else []
                except (httpx.HTTPError, ValueError, AttributeError):
                    continue
                names = frozenset(c["id"] for c in cards if isinstance(c, dict) and "id" in c)
                if names:
                    lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
                    self._names = names
                    self._max_model_len = min(
                        (n for n in lengths if isinstance(n, int)), default=None
                    )
                    return
