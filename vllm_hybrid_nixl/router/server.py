"""Run the router with uvicorn: in a process of its own (the Ray launcher), in a background
thread (tests of the router itself) or in the foreground (CLI), with the header deadline and
the engine-key check before it opens."""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import uvicorn

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.router.app import build_app
from vllm_hybrid_nixl.router.auth import check_engine_access
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.limits import uvicorn_http_protocol
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings, refuse_open_router

READY_LINE = b"router listening"


def configure_router_logging() -> None:
    """Timestamped router log lines on stderr, for a process that runs only the router."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per leg


def uvicorn_config(
    pool: BackendPool, host: str, port: int, settings: RouterSettings, keys: RouterKeys
) -> uvicorn.Config:
    """The router's server; refuses a bind beyond loopback without a client key
    (:func:`refuse_open_router`)."""
    refuse_open_router(host, settings, keys)
    return uvicorn.Config(
        build_app(pool, settings, keys),
        host=host,
        port=port,
        http=uvicorn_http_protocol(settings.header_timeout_s),
        timeout_keep_alive=settings.client_keep_alive_s,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; raises OSError naming the address."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as exc:
        listener.close()
        message = f"the router cannot listen on {host}:{port}: {exc.strerror}"
        raise OSError(exc.errno, message) from exc
    listener.set_inheritable(True)
    return listener


class RouterSetup:
    """What both ways of running the router take: engines, address (port 0 picks a free
    one), settings and keys."""

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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RouterServer(RouterSetup):
    """A router bound to ``host:port`` (port 0 picks a free one), stoppable.

    ``start()`` first asks every engine for ``/v1/models`` with the engine key and raises
    :class:`~vllm_hybrid_nixl.router.auth.EngineAccessError` if one refuses it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = uvicorn_config(self.pool, self.host, self.port, self.settings, self.keys)
        self.app = config.app
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 120.0) -> RouterServer:
        """Binds the port first (so a port taken meanwhile fails here, by name), then serves
        in the background; returns once the startup probes are done."""
        check_engine_access(self.pool.all(), self.keys, self.settings.health_timeout_s)
        listener = bind_listener(self.host, self.port)
        failure: list[BaseException] = []

        def serve() -> None:
            try:
                self._server.run(sockets=[listener])
            except BaseException as exc:  # SystemExit included: uvicorn exits on bad startup
                failure.append(exc)
                raise

        self._thread = threading.Thread(target=serve, name="router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                listener.close()
                why = f": {failure[0]!r}" if failure else " (its startup failed; see the log)"
                raise RuntimeError(f"router on {self.url} stopped before serving{why}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router did not start on {self.url} within {timeout_s:.0f}s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=15)


class RouterProcess(RouterSetup):
    """The router in a process of its own (same arguments as :class:`RouterServer`).

    A process that launches engines (the Ray driver of ``serve``) does other work; in its own
    process the router's event loop has a GIL to itself. Measured here, a router thread in
    the driver of a 2P2D test stalled for seconds (``router_event_loop_lag_seconds``) and its
    connect timeouts fired against healthy engines. The child is ``python -m
    vllm_hybrid_nixl.router.process`` (not a multiprocessing spawn, which would re-run the
    caller's main module); its settings and keys reach it on stdin, never argv or the
    environment. It prints one line when it listens. Stopped by its PID (SIGTERM, then
    SIGKILL), and it dies with its parent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        from vllm_hybrid_nixl.common.processes import die_with_parent

        check_engine_access(self.pool.all(), self.keys, self.settings.health_timeout_s)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "vllm_hybrid_nixl.router.process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(
            pickle.dumps((self.pool, self.host, self.port, self.settings, self.keys))
        )
        self._process.stdin.close()
        ready = threading.Event()

        def wait_for_line() -> None:
            assert self._process is not None and self._process.stdout is not None
            if self._process.stdout.readline().startswith(READY_LINE):
                ready.set()

        threading.Thread(target=wait_for_line, name="router-ready", daemon=True).start()
        if not ready.wait(timeout_s):
            code = self._process.poll()
            self.stop()
            raise RuntimeError(
                f"router did not start on {self.url} within {timeout_s:.0f}s"
                + (f" (it exited with code {code})" if code is not None else "")
            )
        return self

    def stop(self) -> None:
        from vllm_hybrid_nixl.common.processes import stop_child

        stop_child(self._process)
