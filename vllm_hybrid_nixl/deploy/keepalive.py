"""How long an engine keeps an idle HTTP connection open, relative to the router.

A proxy that reuses a pooled connection at the moment the upstream server closes it for
idleness gets a reset (``ReadError('')`` in httpx) instead of an answer. The router drops
its pooled connections after ``keepalive_expiry_s`` (1 s) of idleness as *it* sees it, but a
router busy relaying a slow client's stream learns late that the engine finished, so its
idle clock can start seconds after the engine's. vLLM closes idle connections after 5 s
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); measured here, 64 concurrent requests on two cores hit
that race about once in 250 requests. Engines we start keep idle connections for
``ENGINE_KEEP_ALIVE_S`` instead, far beyond any such lag, so the router always lets go first;
the router in front of such engines keeps its idle connections for
:func:`router_keep_alive_s` of the engines' value (a burst after a quiet spell then finds
its connections open: opening 32 of them at once blocked the router's event loop in
``connect`` for a third of its busy time, measured with py-spy).
"""

from __future__ import annotations

from collections.abc import MutableMapping

KEEP_ALIVE_VAR = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
ENGINE_KEEP_ALIVE_S = 75


def set_engine_keep_alive(env: MutableMapping[str, str]) -> None:
    """Give an engine's environment our keep-alive unless the operator chose one."""
    env.setdefault(KEEP_ALIVE_VAR, str(ENGINE_KEEP_ALIVE_S))


#: Share of the engines' keep-alive the router keeps an idle connection for.
ROUTER_SHARE = 0.4


def engine_keep_alive_s(env: MutableMapping[str, str]) -> float | None:
    """The keep-alive an engine started with ``env`` has, when it can be read."""
    try:
        return float(env.get(KEEP_ALIVE_VAR, ENGINE_KEEP_ALIVE_S))
    except ValueError:
        return None


def router_keep_alive_s(engine_env: MutableMapping[str, str]) -> float | None:
    """How long a router may keep idle connections to engines started with ``engine_env``
    (None: keep the router's default)."""
    engine = engine_keep_alive_s(engine_env)
    return None if engine is None else engine * ROUTER_SHARE
