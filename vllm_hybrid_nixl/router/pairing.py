"""Which prefill engine may hand KV to which decode engine, from their layout fingerprints.

Each engine's fingerprint is read from its NIXL side channel (the same string the engines
compare in their own handshake), in the request form of the engine's own vLLM release,
learned from its ``/version`` (a wrong form kills the engine's listener thread, so an
engine whose release is unknown is not asked). A pair is refused when the fingerprints
differ, one side runs the stock connector, or one side's fingerprint cannot be read (a
newer layout protocol): the reason names the fields, values or protocol versions. Engines
without a side channel, or whose side channel does not answer, are not checked: such a
pair is allowed, logged once as unchecked, and ``/health`` says so; the engines' own
handshake still compares layouts before any KV moves.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx

from vllm_hybrid_nixl.protocol.fingerprint import (
    PROTOCOL_VERSION,
    WIRE_PREFIX,
    LayoutFingerprint,
    decode,
    describe_differences,
    differences,
    is_ours,
)
from vllm_hybrid_nixl.protocol.handshake_probe import (
    ProbeError,
    fetch_compat_string,
    speaks_pp_rank_form,
)
from vllm_hybrid_nixl.router.backends import Backend, BackendPool

logger = logging.getLogger("vllm_hybrid_nixl.router")

#: Why an engine's layout is unknown while its first probe is still under way.
NOT_READ_YET = "not read yet"


@dataclass
class EngineLayout:
    """What the router knows of one engine's layout."""

    fingerprint: LayoutFingerprint | None = None
    stock: bool = False
    error: str = ""  # why it could not be read (yet)
    unreadable: str = ""  # the engine sent a fingerprint this router cannot read

    @property
    def known(self) -> bool:
        return self.fingerprint is not None or self.stock or bool(self.unreadable)

    def summary(self) -> str:
        if self.stock:
            return "stock NixlConnector (layout unchecked)"
        if self.unreadable:
            return f"unreadable fingerprint: {self.unreadable}"
        if self.fingerprint is None:
            return f"unknown: {self.error}" if self.error else "not checked (no side channel)"
        fp = self.fingerprint
        kinds = ",".join(group.kind for group in fp.groups)
        return f"{fp.digest()[:16]} block_size={fp.block_size} groups={kinds}"


def engine_release(backend: Backend, timeout_s: float = 3.0) -> str:
    """The vLLM release an engine reports at ``/version``; raises ProbeError."""
    try:
        response = httpx.get(f"{backend.url}/version", timeout=timeout_s)
        response.raise_for_status()
        return str(response.json()["version"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ProbeError(f"could not read the engine's vLLM release from /version: {exc}") from exc


def probe_layout(backend: Backend, timeout_s: float = 3.0) -> EngineLayout:
    """Read one engine's fingerprint from its side channel, in its release's form."""
    if not backend.side_channel:
        return EngineLayout()
    host, _, port = backend.side_channel.rpartition(":")
    try:
        with_pp_rank = speaks_pp_rank_form(engine_release(backend, timeout_s))
        wire = fetch_compat_string(host, int(port), timeout_s=timeout_s, with_pp_rank=with_pp_rank)
    except (ProbeError, ValueError) as exc:
        return EngineLayout(error=str(exc))
    if not is_ours(wire):
        return EngineLayout(stock=True)
    try:
        return EngineLayout(fingerprint=decode(wire))
    except ValueError as exc:
        protocol = wire[len(WIRE_PREFIX) :].split(":", 1)[0]
        return EngineLayout(
            unreadable=f"layout protocol {protocol!r}, this router reads protocol "
            f"{PROTOCOL_VERSION} ({exc})"
        )


def pair_problem(prefill: Backend, p: EngineLayout, decode_: Backend, d: EngineLayout) -> str:
    """Why ``prefill`` must not hand KV to ``decode_`` ("" when they may pair)."""
    for backend, layout in ((prefill, p), (decode_, d)):
        if layout.stock:
            return (
                f"{backend.role} engine {backend.label} runs vLLM's stock NixlConnector, which "
                "does not check hybrid KV-cache layouts; start it with HybridNixlConnector"
            )
        if layout.unreadable:
            return (
                f"{backend.role} engine {backend.label} sent a layout fingerprint this router "
                f"cannot read ({layout.unreadable}); run the same vllm-hybrid-nixl release "
                "on the router and the engines"
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
        self._warned: set[tuple[str, str]] = set()
        # (prefill url, decode url) -> the two layouts judged and the verdict: every leg asks,
        # and a verdict holds until a refresh replaces either layout object
        self._verdicts: dict[tuple[str, str], tuple[EngineLayout, EngineLayout, str]] = {}
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

    def refresh(self, only_unknown: bool = False, engines: list[Backend] | None = None) -> None:
        """Probe engines (``engines``, default all): all of them, or only those whose layout
        is not known yet."""
        wanted = {b.url for b in engines} if engines is not None else None
        for backend in self._backends:
            if wanted is not None and backend.url not in wanted:
                continue
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
        """What is known of ``backend``'s layout; an engine with a side channel whose first
        probe has not finished yet reads as unknown ("not read yet"), never as unchecked."""
        with self._lock:
            found = self._layouts.get(backend.url)
        if found is not None:
            return found
        return EngineLayout(error=NOT_READ_YET if backend.side_channel else "")

    def problem(self, prefill: Backend, decode_: Backend) -> str:
        p, d = self.layout(prefill), self.layout(decode_)
        key = (prefill.url, decode_.url)
        verdict = self._verdicts.get(key)
        if verdict is not None and verdict[0] is p and verdict[1] is d:
            found = verdict[2]
        else:
            found = pair_problem(prefill, p, decode_, d)
            self._verdicts[key] = (p, d, found)
        if not found and (p.fingerprint is None or d.fingerprint is None):
            if NOT_READ_YET not in (p.error, d.error):  # a probe under way is no verdict yet
                self._warn_unchecked(prefill, p, decode_, d)
        return found

    def _warn_unchecked(
        self, prefill: Backend, p: EngineLayout, decode_: Backend, d: EngineLayout
    ) -> None:
        key = (prefill.url, decode_.url)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(
            "pairing %s -> %s is NOT layout-checked by the router (%s: %s; %s: %s); the "
            "engines' own handshake still compares layouts",
            prefill.label,
            decode_.label,
            prefill.label,
            p.summary(),
            decode_.label,
            d.summary(),
        )

    def problems(self, prefills: list[Backend], decodes: list[Backend]) -> list[str]:
        found = []
        for p in prefills:
            for d in decodes:
                problem = self.problem(p, d)
                if problem:
                    found.append(problem)
        return found


def read_pool_pairing(pool: BackendPool, timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
    """Every engine's layout read once: the problems of the pool's prefill/decode pairs, and
    the engines whose layout could not be read."""
    table = PairingTable(pool.all(), timeout_s=timeout_s)
    table.refresh()
    unread = [b.label for b in pool.all() if not table.layout(b).known]
    return table.problems(pool.prefill, pool.decode), unread
