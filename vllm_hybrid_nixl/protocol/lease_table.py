"""Which finished prefill requests still hold their KV blocks, and why the others do not.

The prefill engine's scheduler owns one :class:`LeaseTable`. A request that finished with
``do_remote_decode`` is *held* for ``lease_s`` seconds. A decode engine *pins* it before it
reads the blocks; a pinned request stays held until the read's completion notice frees it
(vLLM reports it in ``finished_sending``) or ``pin_s`` passes. Blocks are freed only through
:meth:`LeaseTable.settle`, so a pin that succeeded guarantees the bytes stay the prompt's
for the whole read; a pin that fails names when and why the blocks were released.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum


class LeaseState(str, Enum):
    HELD = "held"
    PINNED = "pinned"
    RELEASED = "released"
    TAKEN = "taken"  # pinned by another reader
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class LeaseStatus:
    """One request's lease as the prefill engine sees it at the time of asking."""

    state: LeaseState
    reason: str = ""  # why it was released (RELEASED only)
    released_ago_s: float = 0.0  # seconds between the release and the question
    lease_s: float = 0.0

    @property
    def readable(self) -> bool:
        """Whether a decode engine may read (or has read) the request's blocks."""
        return self.state in (LeaseState.HELD, LeaseState.PINNED)

    def to_wire(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "reason": self.reason,
            "released_ago_s": round(self.released_ago_s, 3),
            "lease_s": self.lease_s,
        }

    @classmethod
    def from_wire(cls, data: object) -> LeaseStatus:
        """Raises ``ValueError`` for anything that is not a lease status of this protocol."""
        if not isinstance(data, dict):
            raise ValueError(f"a lease status must be an object, got {type(data).__name__}")
        try:
            return cls(
                state=LeaseState(str(data.get("state", "unknown"))),
                reason=str(data.get("reason", ""))[:500],
                released_ago_s=float(data.get("released_ago_s", 0.0)),
                lease_s=float(data.get("lease_s", 0.0)),
            )
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"not a lease status: {str(data)[:200]}") from exc


#: Release reasons (the decode engine's error message quotes them).
EXPIRED = "its lease expired before any decode engine pinned it"
PIN_EXPIRED = "the decode engine's pin expired before the read completed"
READ = "a decode engine read it"
TAKEN_BY_OTHER = (
    "another decode request already pinned these blocks (one reader per prefill request: "
    "send each prompt and each of n choices through its own prefill leg)"
)


@dataclass
class _Live:
    deadline: float
    pinned: bool = False
    reader: str = ""  # who pinned it (empty: a reader that did not say)


class LeaseTable:
    """Thread-safe: the scheduler thread settles, the lease server thread pins and asks."""

    def __init__(
        self,
        lease_s: float,
        pin_s: float,
        forget_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``forget_after_s``: how long a release is remembered; at least as long as vLLM's
        own lease, whose late reports of released requests :meth:`settle` must drop."""
        self.lease_s, self.pin_s, self._clock = float(lease_s), float(pin_s), clock
        self.epoch = secrets.token_hex(8)  # a restarted engine has another one
        self._live: dict[str, _Live] = {}
        self._released: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._forget_after_s = float(forget_after_s)
        self._lock = threading.Lock()

    def hold(self, req_id: str) -> None:
        """A request finished on the prefill engine with its blocks kept for a decode."""
        with self._lock:
            self._released.pop(req_id, None)
            self._live[req_id] = _Live(self._clock() + self.lease_s)

    def pin(
        self, req_ids: Iterable[str], readers: dict[str, str] | None = None
    ) -> dict[str, LeaseStatus]:
        """Keep each still-held request's blocks until its read completes (or ``pin_s``).

        ``readers`` names the reader per request; a request already pinned by another named
        reader is refused (``TAKEN``) and its pin left as it was. The same reader pinning
        again renews its pin."""
        now = self._clock()
        readers = readers or {}
        answers = {}
        with self._lock:
            for req_id in req_ids:
                live = self._live.get(req_id)
                reader = readers.get(req_id, "")
                if live is not None and live.deadline > now:
                    if live.pinned and live.reader != reader:
                        answers[req_id] = LeaseStatus(
                            LeaseState.TAKEN, TAKEN_BY_OTHER, lease_s=self.lease_s
                        )
                        continue
                    live.pinned, live.reader = True, reader
                    live.deadline = max(live.deadline, now + self.pin_s)
                answers[req_id] = self._status(req_id, now)
        return answers

    def renew(self, req_ids: Iterable[str]) -> dict[str, LeaseStatus]:
        """A decode request still wants these blocks (it waits for its turn): each lease not
        yet released runs ``lease_s`` from now (never shorter than it was)."""
        now = self._clock()
        answers = {}
        with self._lock:
            for req_id in req_ids:
                live = self._live.get(req_id)
                if live is not None and live.deadline > now:
                    live.deadline = max(live.deadline, now + self.lease_s)
                answers[req_id] = self._status(req_id, now)
        return answers

    def status(self, req_id: str) -> LeaseStatus:
        with self._lock:
            return self._status(req_id, self._clock())

    def _status(self, req_id: str, now: float) -> LeaseStatus:
        live = self._live.get(req_id)
        if live is not None:
            if live.deadline > now:
                state = LeaseState.PINNED if live.pinned else LeaseState.HELD
                return LeaseStatus(state, lease_s=self.lease_s)
            # Past its deadline but not yet settled: as good as released.
            reason = PIN_EXPIRED if live.pinned else EXPIRED
            return LeaseStatus(LeaseState.RELEASED, reason, now - live.deadline, self.lease_s)
        released = self._released.get(req_id)
        if released is not None:
            at, reason = released
            return LeaseStatus(LeaseState.RELEASED, reason, now - at, self.lease_s)
        return LeaseStatus(LeaseState.UNKNOWN, lease_s=self.lease_s)

    def settle(self, finished_sending: set[str]) -> set[str]:
        """What vLLM may free now: ``finished_sending`` (the reads vLLM saw complete) minus
        requests this table already released, plus requests whose lease or pin ran out."""
        now = self._clock()
        free = set()
        with self._lock:
            for req_id in finished_sending:
                if req_id in self._live:
                    del self._live[req_id]
                    self._remember_release(req_id, now, READ)
                    free.add(req_id)
                elif req_id not in self._released:
                    free.add(req_id)  # not one of ours (e.g. no kv_transfer_params kept)
            expired = [r for r, live in self._live.items() if live.deadline <= now]
            for req_id in expired:
                live = self._live.pop(req_id)
                self._remember_release(req_id, now, PIN_EXPIRED if live.pinned else EXPIRED)
                free.add(req_id)
        return free

    def _remember_release(self, req_id: str, at: float, reason: str) -> None:
        self._released[req_id] = (at, reason)
        while self._released:
            oldest, (released_at, _) = next(iter(self._released.items()))
            if at - released_at <= self._forget_after_s:
                break
            del self._released[oldest]

    def held_count(self) -> int:
        with self._lock:
            return len(self._live)
