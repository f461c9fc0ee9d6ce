"""Which prefill engine may hand KV to which decode engine, from their layout fingerprints.

Each engine's fingerprint is read from its NIXL side channel (the same string the engines
compare in their own handshake). A pair is refused when the fingerprints differ or one
side runs the stock connector; the reason names the fields and both values. Engines
without a known side channel are not checked (and ``/health`` says so).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from vllm_hybrid_nixl.fingerprint import (
    LayoutFingerprint,
    decode,
    describe_differences,
    differences,
    is_ours,
)
from vllm_hybrid_nixl.handshake_probe import ProbeError, fetch_compat_string
from vllm_hybrid_nixl.router.backends import Backend


@dataclass
class EngineLayout:
    """What the router knows of one engine's layout."""

    fingerprint: LayoutFingerprint | None = None
    stock: bool = False
    error: str = ""  # why it could not be read (yet)

    @property
    def known(self) -> bool:
        return self.fingerprint is not None or self.stock

    def summary(self) -> str:
        if self.stock:
            return "stock NixlConnector (layout unchecked)"
        if self.fingerprint is None:
            return f"unknown: {self.error}" if self.error else "not checked (no side channel)"
        fp = self.fingerprint
        kinds = ",".join(group.kind for group in fp.groups)
        return f"{fp.digest()[:16]} block_size={fp.block_size} groups={kinds}"


def probe_layout(backend: Backend, timeout_s: float = 3.0) -> EngineLayout:
    """Read one engine's fingerprint from its side channel."""
    if not backend.side_channel:
        return EngineLayout()
    host, _, port = backend.side_channel.rpartition(":")
    try:
        wire = fetch_compat_string(host, int(port), timeout_s=timeout_s)
    except (ProbeError, ValueError) as exc:
        return EngineLayout(error=str(exc))
    if not is_ours(wire):
        return EngineLayout(stock=True)
    try:
        return EngineLayout(fingerprint=decode(wire))
    except ValueError as exc:
        return EngineLayout(error=str(exc))


def pair_problem(prefill: Backend, p: EngineLayout, decode_: Backend, d: EngineLayout) -> str:
    """Why ``prefill`` must not hand KV to ``decode_`` ("" when they may pair)."""
    for backend, layout in ((prefill, p), (decode_, d)):
        if layout.stock:
            return (
                f"{backend.role} engine {backend.label} runs vLLM's stock NixlConnector, which "
                "does not check hybrid KV-cache layouts; start it with HybridNixlConnector"
            )
    if p.fingerprint is None or d.fingerprint is None:
        return ""  # unknown: nothing to compare (yet)
    found = differences(d.fingerprint, p.fingerprint)
    if not found:
        return ""
    return (
        f"KV-cache layouts of {prefill.label} and {decode_.label} differ:\n"
        + describe_differences(found, decode_.label, prefill.label)
    )


class PairingTable:
    """Cached layouts of every engine, refreshed on demand, and the pairs they allow."""

    def __init__(
        self, backends: list[Backend], timeout_s: float = 3.0, retry_after_s: float = 5.0
    ) -> None:
        self._backends = [backend for backend in backends if backend.side_channel]
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._layouts: dict[str, EngineLayout] = {}
        self._probed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def needs_probe(self) -> bool:
        """True when some engine's layout is unknown and its last probe is old enough."""
        now = time.monotonic()
        with self._lock:
            return any(
                not self._layouts.get(b.url, EngineLayout()).known
                and now - self._probed_at.get(b.url, -1e9) >= self._retry_after_s
                for b in self._backends
            )

    def refresh(self, only_unknown: bool = False) -> None:
        """Probe engines: all of them, or only those whose layout is not known yet."""
        for backend in self._backends:
            with self._lock:
                current = self._layouts.get(backend.url)
                last = self._probed_at.get(backend.url, -1e9)
            if only_unknown and (
                (current is not None and current.known)
                or time.monotonic() - last < self._retry_after_s
            ):
                continue
            layout = probe_layout(backend, self._timeout_s)
            with self._lock:
                self._layouts[backend.url] = layout
                self._probed_at[backend.url] = time.monotonic()

    def layout(self, backend: Backend) -> EngineLayout:
        with self._lock:
            return self._layouts.get(backend.url, EngineLayout())

    def problem(self, prefill: Backend, decode_: Backend) -> str:
        return pair_problem(prefill, self.layout(prefill), decode_, self.layout(decode_))

    def problems(self, prefills: list[Backend], decodes: list[Backend]) -> list[str]:
        found = []
        for p in prefills:
            for d in decodes:
                problem = self.problem(p, d)
                if problem:
                    found.append(problem)
        return found
