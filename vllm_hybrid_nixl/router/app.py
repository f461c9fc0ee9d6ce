"""The router's HTTP application: the OpenAI routes (``completions.CompletionHandler``), the
model list, ``/health`` and ``/metrics``, wired to one engine poller (``probes``), one HTTP
pool per engine for the legs and one for probes and model lists.

The two completion routes carry every request and every streamed token, so they are served
by :class:`HotRoutes` in front of FastAPI, without its middleware and routing layers, which
the rest (model list, probes, metrics, 404/405 answers, lifespan) still goes through."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_hybrid_nixl.router.auth import BearerAuthMiddleware
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.completions import CompletionHandler, RelayedStream
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.leg_http import LegClient
from vllm_hybrid_nixl.router.loop_lag import watch_loop_lag
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.models import ServedModels
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.prefix_memory import PrefixMemory
from vllm_hybrid_nixl.router.probes import EngineProbes
from vllm_hybrid_nixl.router.proxy import Disaggregator
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings

__all__ = ["RouterKeys", "RouterSettings", "build_app"]

logger = logging.getLogger(__name__)


class HotRoutes:
    """ASGI app: ``POST /v1/completions`` and ``POST /v1/chat/completions`` straight to the
    handler; everything else to ``app``."""

    ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # -> endpoint

    def __init__(self, app: FastAPI, handler: CompletionHandler) -> None:
        self.app, self.handler = app, handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await self.handler.handle(scope["path"], endpoint, Request(scope, receive))
        await response(scope, receive, send)


def routed(
    handler: CompletionHandler, path: str, endpoint: str
) -> Callable[[Request], Awaitable[Response | RelayedStream]]:
    """A Starlette endpoint for one completion route (what FastAPI would serve it with)."""

    async def serve(request: Request) -> Response | RelayedStream:
        return await handler.handle(path, endpoint, request)

    return serve


def build_app(
    pool: BackendPool, settings: RouterSettings | None = None, keys: RouterKeys | None = None
) -> ASGIApp:
    """The router's ASGI app for ``pool``; ``keys`` default to none (no client or engine
    key)."""
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
    by_prefix = settings.short_prompt_tokens > 0 and settings.colocate_cached_prefixes
    prefix_memory = PrefixMemory() if by_prefix else None
    proxy = Disaggregator(pool, pairing, health, metrics, settings, prefix_memory)
    probes = EngineProbes(pool, pairing, health, metrics, settings, prefix_memory)
    models = ServedModels(pool, settings.health_timeout_s)
    handler = CompletionHandler(proxy, health, metrics, models, settings)

    app = FastAPI(
        title="vllm-hybrid-nixl router", lifespan=lifespan(proxy, probes, metrics, settings, keys)
    )

    # Served by HotRoutes; registered here too for the 405 on other methods.
    for path, endpoint in HotRoutes.ROUTES.items():
        app.router.add_route(path, routed(handler, path, endpoint), methods=["POST"])

    @app.get("/v1/models")
    async def list_models() -> Response:
        return await models.listing(proxy.client, health)

    @app.get("/health")
    async def router_health() -> JSONResponse:
        return health_report(pool, health, pairing, settings.colocated_fallback)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    front: ASGIApp = HotRoutes(app, handler)
    if keys.api_key:
        front = BearerAuthMiddleware(
            front, api_key=keys.api_key, protect_probes=settings.protect_probes
        )
    return front


def lifespan(
    proxy: Disaggregator,
    probes: EngineProbes,
    metrics: RouterMetrics,
    settings: RouterSettings,
    keys: RouterKeys,
):
    """Opens the HTTP pools, probes every engine once (no leg goes to an engine not seen
    healthy), then keeps probing and watching event-loop lag until shutdown."""
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_connections,
        # well below the engines' keep-alive (see deploy/keepalive.py)
        keepalive_expiry=settings.keepalive_expiry_s,
    )

    def new_client() -> httpx.AsyncClient:
        return httpx.AsyncClient(
            limits=limits, timeout=settings.prefill_timeout_s, headers=keys.engine_headers()
        )

    @asynccontextmanager
    async def run(_: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as clients:
            client = await clients.enter_async_context(new_client())  # probes, model list
            proxy.client = client
            proxy.legs = await LegClient(settings, keys.engine_headers()).open()
            clients.push_async_callback(proxy.legs.aclose)
            try:
                await probes.probe_all(client)
            except Exception:  # the router still opens; the next round probes again
                logger.exception("the first probe round failed; engines not yet seen healthy")
            watchers = [
                asyncio.create_task(probes.probe_forever(client)),
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

    return run


def health_report(
    pool: BackendPool,
    health: HealthTracker,
    pairing: PairingTable,
    colocated_fallback: bool = False,
) -> JSONResponse:
    """``/health``: every engine's state and layout; 200 while some prefill/decode pair is up
    and compatible, or (``colocated_fallback``) while some engine is up and no layout refusal
    stands between the roles (``degraded``), else 503."""
    engines = [
        {
            "name": b.label,
            "role": b.role,
            "url": b.url,
            "side_channel": b.side_channel,
            **health.snapshot(b),
            "layout": pairing.layout(b).summary(),
        }
        for b in pool.all()
    ]
    up = {e["url"] for e in engines if e["up"]}
    compatible = [(p, d) for p in pool.prefill for d in pool.decode if not pairing.problem(p, d)]
    pairable = [(p, d) for p, d in compatible if p.url in up and d.url in up]
    if pairable:
        status = "ok"
    elif compatible and up and colocated_fallback:
        status = "degraded: no prefill/decode pair is up; requests run colocated"
    else:
        status = "unavailable"
    return JSONResponse(
        {
            "status": status,
            "engines": engines,
            "pairing_problems": pairing.problems(pool.prefill, pool.decode),
        },
        status_code=503 if status == "unavailable" else 200,
    )
