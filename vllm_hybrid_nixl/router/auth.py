"""Who may call the router, and whether the router may call its engines.

Clients: ``Authorization: Bearer <key>`` on every ``/v1/*`` route (as ``vllm serve
--api-key`` does), and on ``/health`` and ``/metrics`` when they are protected.
Engines: before the router opens, every engine is asked for ``/v1/models`` with the
router's engine key; a refusal stops the router at start-up instead of failing each request.
"""

from __future__ import annotations

import hmac
import json

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_hybrid_nixl.router.backends import Backend
from vllm_hybrid_nixl.router.settings import ENGINE_API_KEY_ENV, RouterKeys

PROBE_PATHS = ("/health", "/metrics")


class EngineAccessError(RuntimeError):
    """An engine refused the router's key (or demands one the router does not have)."""


def _unauthorized_body(message: str) -> bytes:
    error = {"message": message, "type": "authentication_error", "code": 401}
    return json.dumps({"error": error}).encode()


class BearerAuthMiddleware:
    """Pure ASGI middleware (streams pass through untouched) checking the bearer key."""

    def __init__(self, app: ASGIApp, api_key: str, protect_probes: bool) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._protect_probes = protect_probes

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (self._protect_probes and path in PROBE_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(presented, self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send `Authorization: Bearer <key>`"
            if not presented
            else "invalid API key"
        )
        body = _unauthorized_body(message)
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def check_engine_access(
    backends: list[Backend], keys: RouterKeys, timeout_s: float = 5.0
) -> list[str]:
    """Raise :class:`EngineAccessError` when an engine answers 401 to the router's key.

    Returns the engines that could not be reached (they may still be starting; the router's
    health checks deal with them)."""
    unreachable: list[str] = []
    refused: list[str] = []
    with httpx.Client(timeout=timeout_s, headers=keys.engine_headers()) as client:
        for backend in backends:
            try:
                response = client.get(f"{backend.url}/v1/models")
            except httpx.HTTPError:
                unreachable.append(backend.label)
                continue
            if response.status_code == 401:
                refused.append(f"{backend.label} ({backend.url})")
    if refused:
        what = (
            "the router's engine key was refused"
            if keys.engine_api_key
            else "they require an API key and the router has none"
        )
        raise EngineAccessError(
            f"engines {', '.join(refused)} answered 401 Unauthorized: {what}. Set "
            f"{ENGINE_API_KEY_ENV} (or --engine-api-key) to the key the engines were started "
            "with (their VLLM_API_KEY / --api-key)."
        )
    return unreachable
