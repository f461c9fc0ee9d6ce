"""Error answers as clients see them: OpenAI-style bodies, engines named but never their
addresses (those go to the router's log)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse

from vllm_hybrid_nixl.router.proxy import LegError

logger = logging.getLogger("vllm_hybrid_nixl.router")


def error_response(status: int, message: str, error_type: str, **extra: Any) -> JSONResponse:
    """An OpenAI-style error body: message, type, code, and any ``extra`` fields."""
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "code": status, **extra}},
        status_code=status,
    )


def leg_error_response(error: LegError, request_id: str = "") -> JSONResponse:
    """A failed leg as the client sees it: the engine's own message, type and param for a
    request the engine judged; engines by name only (addresses go to the log)."""
    if request_id:
        logger.warning("request %s: %s", request_id, error.message)
    upstream = error.upstream if error.kind == "client_error" else {}
    return error_response(
        error.status,
        error.public_message,
        str(upstream.get("type") or "upstream_error"),
        param=upstream.get("param"),
        leg=error.leg,
        engine=error.backend.label,
        kind=error.kind,
        request_id=request_id or None,
    )


def stream_error_event(message: str) -> bytes:
    error = {"message": message, "type": "upstream_error", "code": 502}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
