"""The engines behind the router, in rotation order (``policy.py`` chooses among them)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field


class NoCompatiblePairError(LookupError):
    """Every prefill/decode pair was refused; ``reasons`` says why."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__(
            "no prefill/decode pair may exchange KV (they would corrupt it):\n" + "\n".join(reasons)
        )
        self.reasons = reasons


@dataclass(frozen=True)
class Backend:
    """One vLLM engine the router can send a leg to."""

    url: str  # http://host:port
    role: str  # "prefill" | "decode"
    name: str = ""
    side_channel: str = ""  # host:port of its NIXL side channel, for the layout check

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
        self._turn: dict[str, int] = {}

    def __reduce__(self) -> tuple[type[BackendPool], tuple[list[Backend], list[Backend]]]:
        """Pickled (for the router's own process) as its engines; rotation starts afresh."""
        return (BackendPool, (self.prefill, self.decode))

    @classmethod
    def from_urls(
        cls,
        prefill_urls: list[str],
        decode_urls: list[str],
        prefill_side_channels: list[str] | None = None,
        decode_side_channels: list[str] | None = None,
    ) -> BackendPool:
        """Engines by URL; side channels (``host:port``), when given, follow the URLs' order."""

        def backends(role: str, urls: list[str], channels: list[str] | None) -> list[Backend]:
            channels = list(channels or [])
            if channels and len(channels) != len(urls):
                raise ValueError(
                    f"{len(urls)} {role} URL(s) but {len(channels)} {role} side channel(s); "
                    f"give one side channel per {role} engine, in the same order, or none"
                )
            channels += [""] * (len(urls) - len(channels))
            return [
                Backend(url.rstrip("/"), role, f"{role}-{i}", channel)
                for i, (url, channel) in enumerate(zip(urls, channels, strict=True))
            ]

        return cls(
            backends("prefill", prefill_urls, prefill_side_channels),
            backends("decode", decode_urls, decode_side_channels),
        )

    def next_pair(self, problem: Callable[[Backend, Backend], str]) -> tuple[Backend, Backend]:
        """The next prefill engine (round-robin) and the next decode engine allowed to pair
        with it; ``problem(p, d)`` says why a pair is refused ("" when allowed)."""
        reasons: list[str] = []
        with self._lock:
            if self._prefill_cycle is None or self._decode_cycle is None:
                missing = "prefill" if self._prefill_cycle is None else "decode"
                raise LookupError(f"no {missing} engine is configured")
            for _ in range(len(self.prefill)):
                prefill = next(self._prefill_cycle)
                for _ in range(len(self.decode)):
                    decode = next(self._decode_cycle)
                    reason = problem(prefill, decode)
                    if not reason:
                        return prefill, decode
                    if reason not in reasons:
                        reasons.append(reason)
        raise NoCompatiblePairError(reasons)

    def pick(
        self,
        role: str,
        usable: Callable[[Backend], bool],
        exclude: Collection[Backend] = (),
        choose: Callable[[list[Backend]], Backend] | None = None,
    ) -> Backend | None:
        """An engine of ``role`` not in ``exclude`` for which ``usable`` holds (None when there
        is none): ``choose`` picks among them, given in round-robin order (without it, the
        first: plain rotation)."""
        engines = self.prefill if role == "prefill" else self.decode
        with self._lock:
            start = self._turn.get(role, 0)
            self._turn[role] = start + 1
        candidates = [
            backend
            for backend in (engines[(start + i) % len(engines)] for i in range(len(engines)))
            if backend not in exclude and usable(backend)
        ]
        if not candidates:
            return None
        return choose(candidates) if choose is not None else candidates[0]

    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]
