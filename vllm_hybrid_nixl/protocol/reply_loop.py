"""The serving loop of our ZeroMQ REP services (the lease service, the KV digest service):
one JSON reply to every message, and no message — malformed, hostile, or one the answer
fails on — ends the loop."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger("vllm.hybrid_nixl")

#: How often a stoppable loop looks at its stop flag while no message comes.
STOP_POLL_MS = 100


def serve_replies(
    socket: zmq.Socket,
    answer: Callable[[bytes], dict[str, object]],
    failed: Callable[[Exception], dict[str, object]],
    service: str,
    stop: threading.Event | None = None,
) -> None:
    """Answer every message on ``socket`` with ``answer(raw)`` (``failed(exc)`` when that
    raises) until the context ends, or until ``stop`` is set."""
    while stop is None or not stop.is_set():
        try:
            if stop is not None and not socket.poll(STOP_POLL_MS):
                continue
            raw = socket.recv()
        except zmq.ContextTerminated:
            return  # the process is ending
        except zmq.ZMQError as exc:
            logger.warning("vllm-hybrid-nixl: %s receive failed: %s", service, exc)
            continue
        try:
            reply = answer(raw)
        except Exception as exc:  # noqa: BLE001 - no message may end the service
            logger.exception("vllm-hybrid-nixl: %s failed to answer a message", service)
            reply = failed(exc)
        try:
            socket.send(json.dumps(reply).encode())
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError as exc:
            logger.warning("vllm-hybrid-nixl: %s reply failed: %s", service, exc)
