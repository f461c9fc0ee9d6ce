"""What a draining engine answers, and how a router recognises it.

An engine asked to stop (SIGTERM) answers every new request, and ``/health``, with HTTP 503
and this OpenAI-style error body; a router that sees ``error.type`` ==
:data:`DRAINING_TYPE` knows the request never ran there and may send it elsewhere.
"""

from __future__ import annotations

import json

DRAINING_TYPE = "EngineDraining"
DRAINING_MESSAGE = (
    "this engine is shutting down (draining) and takes no new requests; send the request "
    "to another engine"
)


def draining_body() -> bytes:
    """The 503's JSON body."""
    return json.dumps(
        {"error": {"message": DRAINING_MESSAGE, "type": DRAINING_TYPE, "code": 503}}
    ).encode()
