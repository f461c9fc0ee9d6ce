"""The router's one engine poller: ``/health`` of every engine each probe interval, and the
engines' layouts (for pairing) when unknown, when an engine comes (back) up — a restarted
engine may have another layout — and all of them every ``LAYOUT_REFRESH_S``; with
conditional disaggregation on, whether a decode engine that came (back) up caches prefixes
(its ``/metrics``). Request handlers only read what this cached."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vllm_hybrid_nixl.router.backends import Backend, BackendPool
from vllm_hybrid_nixl.router.health import HealthTracker
from vllm_hybrid_nixl.router.metrics import RouterMetrics
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.router.prefix_memory import PrefixMemory
from vllm_hybrid_nixl.router.settings import RouterSettings

#: Seconds between full re-reads of every engine's layout.
LAYOUT_REFRESH_S = 30.0


class EngineProbes:
    """Health and layout probes for every engine of ``pool``."""

    def __init__(
        self,
        pool: BackendPool,
        pairing: PairingTable,
        health: HealthTracker,
        metrics: RouterMetrics,
        settings: RouterSettings,
        prefix_memory: PrefixMemory | None = None,
    ) -> None:
        self.pool, self.pairing, self.health = pool, pairing, health
        self.metrics, self.settings = metrics, settings
        self.prefix_memory = prefix_memory
        self._caching_unread: set[str] = set()  # decode engines whose /metrics did not say
        self._layouts_read_at = time.monotonic()

    async def probe(self, client: httpx.AsyncClient, backend: Backend) -> None:
        try:
            response = await client.get(
                f"{backend.url}/health", timeout=self.settings.health_timeout_s
            )
            ok, detail = response.status_code == 200, f"/health: HTTP {response.status_code}"
            timed_out = False
        except httpx.HTTPError as exc:
            ok, detail = False, f"/health: {exc!r}"
            timed_out = isinstance(exc, httpx.TimeoutException)
        self.health.record_probe(backend, ok, "" if ok else detail, timed_out)
        self.metrics.engine_up.labels(backend.url, backend.role).set(
            1 if self.health.state(backend).value == "up" else 0
        )

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        """Every engine's health, then the layouts that need reading."""
        engines = self.pool.all()
        was_up = {b.url for b in engines if self.health.state(b).value == "up"}
        await asyncio.gather(*(self.probe(client, b) for b in engines))
        came_up = [b for b in engines if self.health.state(b).value == "up" and b.url not in was_up]
        if self.prefix_memory is not None:
            memory = self.prefix_memory
            for backend in came_up:  # before any await: a restart's cache is empty, and
                memory.engine_up(backend.url, caches_prefixes=False)  # unknown until read
            unread = [
                b
                for b in engines
                if b.url in self._caching_unread and self.health.state(b).value == "up"
            ]
            decode = {b.url: b for b in [*came_up, *unread] if b.role == "decode"}
            await asyncio.gather(
                *(self.read_prefix_caching(client, b) for b in decode.values()),
                return_exceptions=True,
            )
        if time.monotonic() - self._layouts_read_at >= LAYOUT_REFRESH_S:
            self._layouts_read_at = time.monotonic()
            await asyncio.to_thread(self.pairing.refresh)
        elif came_up:
            await asyncio.to_thread(self.pairing.refresh, False, came_up)
        elif self.pairing.needs_probe():
            await asyncio.to_thread(self.pairing.refresh, True)

    async def read_prefix_caching(self, client: httpx.AsyncClient, backend: Backend) -> None:
        """Whether ``backend`` caches prefixes, from its ``vllm:cache_config_info``; an
        engine whose metrics cannot be read counts as not caching and is read again at the
        next probe round."""
        assert self.prefix_memory is not None
        caching = None
        with suppress(httpx.HTTPError):
            response = await client.get(
                f"{backend.url}/metrics", timeout=self.settings.health_timeout_s
            )
            if response.status_code == 200:
                caching = prefix_caching_on(response.text)
        if caching is None:  # not caching until a later round reads it
            self._caching_unread.add(backend.url)
            return
        self._caching_unread.discard(backend.url)
        self.prefix_memory.engine_up(backend.url, caching)

    async def probe_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            with suppress(Exception):  # a probe round must never end the loop
                await self.probe_all(client)


def prefix_caching_on(metrics_text: str) -> bool | None:
    """``enable_prefix_caching`` from vLLM's ``vllm:cache_config_info`` gauge in a
    ``/metrics`` page; None where the page does not say (or cannot be parsed)."""
    try:
        for family in text_string_to_metric_families(metrics_text):
            if family.name != "vllm:cache_config_info":
                continue
            for sample in family.samples:
                value = sample.labels.get("enable_prefix_caching")
                if value is not None:
                    return value == "True"
    except Exception:  # an engine's page is untrusted text: unreadable means "not said"
        return None
    return None
