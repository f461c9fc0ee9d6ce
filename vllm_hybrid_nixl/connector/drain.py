"""Drain on SIGTERM: an engine asked to stop leaves rotation first and loses no request.

:class:`DrainGate` is an ASGI middleware for vLLM's API server (``--middleware``; our launcher
adds it). It replaces vLLM's SIGTERM handler with a drain:

1. At once, ``/health`` and every new request answer 503 (error type ``EngineDraining``):
   routers take the engine out of rotation and send the request elsewhere (our router
   counts it as never delivered). Requests already accepted run on, streams included.
2. When none is left, or after :data:`DRAIN_ENV` seconds, it sends itself SIGINT, which starts
   vLLM's own shutdown. With ``--shutdown-timeout`` above 0 (the launcher's default) vLLM's
   engine core keeps stepping until it has no work; for a prefill engine that includes every
   finished request whose blocks are held for a decode engine, so the reads its leases
   promised are served (a lease that no decode pins runs out after its lease time).

A second SIGTERM skips the wait. SIGINT (Ctrl-C) is left to vLLM.
:func:`with_drain` adds the gate and a shutdown timeout to ``vllm serve`` arguments.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

from vllm_hybrid_nixl.protocol.draining import draining_body

logger = logging.getLogger("vllm.hybrid_nixl.drain")

#: Seconds the gate waits for accepted requests before vLLM's shutdown starts.
DRAIN_ENV = "VLLM_HYBRID_NIXL_DRAIN_S"
DEFAULT_DRAIN_S = 60.0
#: Paths that are not requests (probes, metrics): never counted, and /metrics stays open.
NOT_REQUESTS = frozenset({"/health", "/metrics", "/ping", "/version", "/load"})


def drain_seconds() -> float:
    """The wait of step 2, from :data:`DRAIN_ENV` (default :data:`DEFAULT_DRAIN_S`)."""
    raw = os.environ.get(DRAIN_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_DRAIN_S
    except ValueError:
        logger.warning("%s=%r is not a number; draining for %g s", DRAIN_ENV, raw, DEFAULT_DRAIN_S)
        return DEFAULT_DRAIN_S
    return max(value, 0.0)


class DrainGate:
    """The ASGI middleware: counts accepted requests, refuses new ones once draining."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._installed = False
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._installed:
            self._install()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.draining and path != "/metrics":
            await self._refuse(send)
            return
        if path in NOT_REQUESTS:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def _refuse(self, send: Any) -> None:
        body = draining_body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _install(self) -> None:
        """Take SIGTERM over on the server's loop (after vLLM registered its own handler)."""
        self._installed = True
        try:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.start_drain)
        except (NotImplementedError, RuntimeError, ValueError) as exc:
            logger.warning("vllm-hybrid-nixl: no drain on SIGTERM here (%s)", exc)
            return
        logger.info(
            "vllm-hybrid-nixl: SIGTERM drains this engine (503 to new requests, up to %g s "
            "for accepted ones, then vLLM's shutdown)",
            drain_seconds(),
        )

    def start_drain(self) -> None:
        """SIGTERM: the first starts the drain, a second ends the wait at once."""
        if self.draining:
            logger.info("vllm-hybrid-nixl: second SIGTERM; shutting down now")
            os.kill(os.getpid(), signal.SIGINT)
            return
        self.draining = True
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        self._task = asyncio.get_running_loop().create_task(
            self._drain(self._idle, drain_seconds())
        )

    async def _drain(self, idle: asyncio.Event, wait_s: float) -> None:
        started = time.monotonic()
        logger.info(
            "vllm-hybrid-nixl: draining: new requests get 503; waiting for %d accepted "
            "request(s), at most %g s",
            self.in_flight,
            wait_s,
        )
        try:
            await asyncio.wait_for(idle.wait(), timeout=wait_s)
            logger.info(
                "vllm-hybrid-nixl: drained: every accepted request ended (%.1f s); starting "
                "vLLM's shutdown",
                time.monotonic() - started,
            )
        except asyncio.TimeoutError:
            logger.warning(
                "vllm-hybrid-nixl: %d request(s) still running after %g s (%s); starting "
                "vLLM's shutdown anyway",
                self.in_flight,
                wait_s,
                DRAIN_ENV,
            )
        os.kill(os.getpid(), signal.SIGINT)


GATE = f"{__name__}.DrainGate"
#: ``--shutdown-timeout`` when none is given: above the default KV lease (30 s), so blocks
#: held for a decode engine outlive their lease rather than the engine.
DEFAULT_SHUTDOWN_TIMEOUT_S = 45


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


def with_drain(serve_args: list[str]) -> list[str]:
    """``vllm serve`` arguments with the drain gate as middleware and a shutdown timeout
    (each kept as given when the arguments name one)."""
    args = list(serve_args)
    if GATE not in args and f"--middleware={GATE}" not in args:
        args += ["--middleware", GATE]
    if not _given(args, "--shutdown-timeout"):
        args += ["--shutdown-timeout", str(DEFAULT_SHUTDOWN_TIMEOUT_S)]
    return args
