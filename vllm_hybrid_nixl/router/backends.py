"""The engines behind the router and the policy that picks one per leg (round-robin)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    """One vLLM engine the router can send a leg to."""

    url: str  # http://host:port
    role: str  # "prefill" | "decode"
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.url


@dataclass
class BackendPool:
    """Prefill and decode engines; ``next_*`` rotate through them."""

    prefill: list[Backend] = field(default_factory=list)
    decode: list[Backend] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._prefill_cycle = itertools.cycle(self.prefill) if self.prefill else None
        self._decode_cycle = itertools.cycle(self.decode) if self.decode else None

    @classmethod
    def from_urls(cls, prefill_urls: list[str], decode_urls: list[str]) -> BackendPool:
        return cls(
            [
                Backend(url.rstrip("/"), "prefill", f"prefill-{i}")
                for i, url in enumerate(prefill_urls)
            ],
            [
                Backend(url.rstrip("/"), "decode", f"decode-{i}")
                for i, url in enumerate(decode_urls)
            ],
        )

    def next_prefill(self) -> Backend:
        with self._lock:
            if self._prefill_cycle is None:
                raise LookupError("no prefill engine is configured")
            return next(self._prefill_cycle)

    def next_decode(self) -> Backend:
        with self._lock:
            if self._decode_cycle is None:
                raise LookupError("no decode engine is configured")
            return next(self._decode_cycle)

    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]
