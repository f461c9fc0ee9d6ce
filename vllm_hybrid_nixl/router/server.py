"""Run the router with uvicorn in a background thread (for the driver and tests)."""

from __future__ import annotations

import threading
import time

import uvicorn

from vllm_hybrid_nixl.netutil import free_port
from vllm_hybrid_nixl.router.app import RouterSettings, build_app
from vllm_hybrid_nixl.router.backends import BackendPool


class RouterServer:
    """A router bound to ``host:port`` (port 0 picks a free one), stoppable."""

    def __init__(
        self,
        pool: BackendPool,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: RouterSettings | None = None,
    ) -> None:
        if port == 0:
            port = free_port(host)
        self.host, self.port = host, port
        self.app = build_app(pool, settings)
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning", access_log=False, lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="router", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
