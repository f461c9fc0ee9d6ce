"""The router's settings: timeouts, input limits (config files, flags) and keys (environment).

Keys live apart from the other settings on purpose: settings may come from a YAML file or
the command line, keys only from the environment (or an explicit flag), so they never land
in a config file, a process listing or a ``repr``.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Environment variables the router reads its keys from.
API_KEY_ENV = "VLLM_HYBRID_NIXL_API_KEY"  # clients must send it as `Authorization: Bearer`
ENGINE_API_KEY_ENV = "VLLM_HYBRID_NIXL_ENGINE_API_KEY"  # what the router sends to engines
# What `vllm serve` reads its own key from; our launchers set it for the engines they start.
VLLM_ENGINE_KEY_ENV = "VLLM_API_KEY"


class RouterSettings(BaseModel):
    """Timeouts and input limits of the router (everything but the keys)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm-hybrid-nixl", "vllm-router"] = Field(
        "vllm-hybrid-nixl",
        description="the data plane: this package's router, or vllm-router (Rust; started "
        "after the same layout-pairing check, without keys, lease re-runs or per-pair refusals)",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="to open a connection to an engine")
    prefill_timeout_s: float = Field(300.0, gt=0, description="the whole prefill leg")
    decode_read_timeout_s: float = Field(
        300.0, gt=0, description="longest silence while reading the decode answer"
    )
    health_timeout_s: float = Field(3.0, gt=0, description="for /health and /v1/models probes")
    max_connections: int = Field(256, ge=1, description="pooled connections to each engine")
    # Far below the engines' keep-alive (75 s for engines we start, see keepalive.py; vLLM's
    # default is 5 s): a router busy relaying learns late that a response ended.
    keepalive_expiry_s: float = Field(
        1.0, ge=0, description="drop pooled engine connections idle this long"
    )
    probe_interval_s: float = Field(
        2.0, gt=0, description="how often each engine's /health is probed"
    )
    probe_failures_to_eject: int = Field(
        2, ge=1, description="failed probes in a row that take an engine out of rotation"
    )
    request_failures_to_open: int = Field(
        3, ge=1, description="failed legs in a row that open an engine's circuit breaker"
    )
    open_cooldown_s: float = Field(
        10.0, gt=0, description="how long a breaker stays open before one trial leg"
    )
    prefill_policy: Literal["least_in_flight", "round_robin", "prefix_affinity"] = Field(
        "least_in_flight",
        description="which prefill engine gets a leg: fewest legs in flight, strict rotation, "
        "or the same prompt prefix to the same engine (prefix-cache hits)",
    )
    decode_policy: Literal["least_in_flight", "round_robin"] = Field(
        "least_in_flight", description="which decode engine gets a leg"
    )
    prefill_attempts: int = Field(3, ge=1, description="prefill engines tried for one request")
    decode_attempts: int = Field(
        2, ge=1, description="decode engines tried when one cannot be reached"
    )
    request_retries: int = Field(
        1, ge=0, description="whole-request re-runs after a decode engine's 5xx or broken link"
    )
    colocated_fallback: bool = Field(
        True,
        description="when no prefill (or no decode) engine can take a request, e.g. during a "
        "rolling restart, run it whole on an engine that is up (a decode engine first) "
        "instead of failing it",
    )
    short_prompt_tokens: int = Field(
        0,
        ge=0,
        description="conditional disaggregation: a prompt shorter than this many tokens "
        "(text: estimated at 4 UTF-8 bytes a token) runs colocated on a decode engine, with no "
        "prefill hop and no KV transfer; 0 sends every prompt through a prefill engine",
    )
    colocate_cached_prefixes: bool = Field(
        True,
        description="with short_prompt_tokens set: a prompt whose start a decode engine "
        "already holds in its prefix cache (as far as the router saw: prompts it sent there, "
        "engines whose prefix caching is on), with fewer than short_prompt_tokens tokens left "
        "to prefill, runs colocated on that engine",
    )
    protect_probes: bool = Field(
        False, description="require the API key on /health and /metrics too"
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1, description="largest request body")
    max_prompt_chars: int = Field(
        262_144, ge=1, description="longest text prompt (sum over a batch or chat messages)"
    )
    max_prompt_tokens: int = Field(131_072, ge=1, description="longest token-id prompt")
    max_tokens: int = Field(32_768, ge=1, description="largest max_tokens a request may ask")
    max_n: int = Field(
        16, ge=1, description="largest n (each choice runs as its own prefill and decode)"
    )
    max_fanout: int = Field(
        64,
        ge=1,
        description="most P/D requests one client request becomes (prompts of a batch x n)",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a client must send its request headers within this"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="... and its body within this")
    client_keep_alive_s: int = Field(
        75,
        ge=1,
        description="an idle client connection stays open this long: longer than clients keep "
        "theirs (httpx 5 s, aiohttp 15 s), so the client lets go first and never sends a "
        "request on a connection the router is closing",
    )
    allow_unauthenticated_remote: bool = Field(
        False,
        description="let a router bound beyond loopback serve without a client key "
        f"({API_KEY_ENV}); anyone who reaches the port can then use the engines",
    )


@dataclass(frozen=True)
class RouterKeys:
    """``api_key``: what clients must present; ``engine_api_key``: what the router presents
    to the engines (their ``vllm serve`` key). ``None`` disables each check."""

    api_key: str | None = field(default=None, repr=False)
    engine_api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, api_key: str | None = None, engine_api_key: str | None = None) -> RouterKeys:
        """Explicit values win; otherwise the environment; empty strings mean no key."""
        return cls(
            api_key or os.environ.get(API_KEY_ENV) or None,
            engine_api_key or os.environ.get(ENGINE_API_KEY_ENV) or None,
        )

    def engine_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.engine_api_key}"} if self.engine_api_key else {}

    def secrets(self) -> list[str]:
        return [key for key in (self.api_key, self.engine_api_key) if key]


class UnsafeBindError(ValueError):
    """A router bound beyond loopback with no client key, not explicitly allowed."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the router reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def refuse_open_router(host: str, settings: RouterSettings, keys: RouterKeys) -> None:
    """Raise :class:`UnsafeBindError` for a router on ``host`` that anyone could use."""
    if is_loopback(host) or keys.api_key or settings.allow_unauthenticated_remote:
        return
    raise UnsafeBindError(
        f"the router would listen on {host}, beyond this machine, with no client key: anyone "
        "who reaches that port could run requests on your engines. Set a client key "
        f"({API_KEY_ENV}=... in the router's environment), bind 127.0.0.1 (router host), or "
        "say explicitly that this is intended: --allow-unauthenticated-remote (Ray configs: "
        "router: {allow_unauthenticated_remote: true})."
    )
