"""Run the router with uvicorn: in a background thread (driver, tests) or in the foreground
(CLI), with the header deadline and the engine-key check before it opens."""

from __future__ import annotations

import threading
import time

import uvicorn

from vllm_hybrid_nixl.netutil import free_port
from vllm_hybrid_nixl.router.app import build_app
from vllm_hybrid_nixl.router.auth import check_engine_access
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.limits import uvicorn_http_protocol
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings


def uvicorn_config(
    pool: BackendPool, host: str, port: int, settings: RouterSettings, keys: RouterKeys
) -> uvicorn.Config:
    return uvicorn.Config(
        build_app(pool, settings, keys),
        host=host,
        port=port,
        http=uvicorn_http_protocol(settings.header_timeout_s),
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


class RouterServer:
    """A router bound to ``host:port`` (port 0 picks a free one), stoppable.

    ``start()`` first asks every engine for ``/v1/models`` with the engine key and raises
    :class:`~vllm_hybrid_nixl.router.auth.EngineAccessError` if one refuses it."""

    def __init__(
        self,
        pool: BackendPool,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: RouterSettings | None = None,
        keys: RouterKeys | None = None,
    ) -> None:
        if port == 0:
            port = free_port(host)
        self.host, self.port = host, port
        self.pool = pool
        self.settings = settings or RouterSettings()
        self.keys = keys or RouterKeys()
        config = uvicorn_config(pool, host, port, self.settings, self.keys)
        self.app = config.app
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="router", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterServer:
        check_engine_access(self.pool.all(), self.keys, self.settings.health_timeout_s)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=15)
