"""The router's one models fetcher: what the engines serve, from their ``/v1/models``."""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi.responses import Response

from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.proxy import LegError, client_status, upstream_detail
from vllm_hybrid_nixl.router.responses import leg_error_response


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

    async def listing(self, client: httpx.AsyncClient, health: HealthTracker) -> Response:
        """``GET /v1/models`` answered by a usable engine (decode engines first)."""
        pool = self._pool
        backend = next(
            (b for b in [*pool.decode, *pool.prefill] if health.usable(b)),
            pool.decode[0] if pool.decode else pool.prefill[0],
        )
        try:
            response = await client.get(f"{backend.url}/v1/models", timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            return leg_error_response(
                LegError("models", backend, 502, f"engine unreachable: {exc!r}", "unreachable")
            )
        if response.status_code != 200:
            status = client_status(response.status_code)
            return leg_error_response(
                LegError("models", backend, status, upstream_detail(response), "engine_error")
            )
        return Response(response.content, status_code=200, media_type="application/json")
