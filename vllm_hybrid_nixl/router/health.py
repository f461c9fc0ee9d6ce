"""Which engines may take a leg now: health probes plus a circuit breaker per engine.

An engine is *up* after a successful probe of its ``/health``. It goes *down* after
``probe_failures_to_eject`` failed probes in a row (a probe that only timed out does not
count while the engine answered a leg within ``BUSY_GRACE_S``: it is busy, not gone), and
*open* (breaker tripped) after ``request_failures_to_open`` failed legs in a row. Once
``open_cooldown_s`` has passed, an open engine is up again after a good probe, and admits
one trial leg (*half-open* while it runs); the trial's success closes the breaker, its
failure opens it again, and a trial that ends with no outcome (its client left) admits
another after the cooldown. Looking (:meth:`HealthTracker.usable`) never changes a state;
only a leg that really starts does (:meth:`HealthTracker.leg_started`). Engines start
*unknown* and take no traffic until a first probe answers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum

from vllm_hybrid_nixl.router.backends import Backend

#: A probe that timed out is not held against an engine that answered a leg this recently.
BUSY_GRACE_S = 30.0


class EngineState(str, Enum):
    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class EngineHealth:
    state: EngineState = EngineState.UNKNOWN
    probe_failures: int = 0
    request_failures: int = 0
    opened_at: float = 0.0
    trial_at: float = 0.0  # when the half-open trial leg started
    last_error: str = ""
    changed_at: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    last_success_at: float = float("-inf")  # when a leg to it last succeeded


class HealthTracker:
    """Thread-safe per-engine health state; ``clock`` is injectable for tests."""

    def __init__(
        self,
        backends: list[Backend],
        probe_failures_to_eject: int = 2,
        request_failures_to_open: int = 3,
        open_cooldown_s: float = 10.0,
        clock=time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._eject_after = probe_failures_to_eject
        self._open_after = request_failures_to_open
        self._cooldown = open_cooldown_s
        self._engines = {b.url: EngineHealth() for b in backends}

    def _set(self, health: EngineHealth, state: EngineState) -> None:
        if health.state is not state:
            health.state, health.changed_at = state, self._clock()

    def state(self, backend: Backend) -> EngineState:
        return self._engines[backend.url].state

    def usable(self, backend: Backend) -> bool:
        """May a leg go to ``backend`` now? Up engines, and breakers due a trial leg: open
        past the cooldown, or half-open with a trial older than the cooldown."""
        with self._lock:
            return self._usable(self._engines[backend.url], self._clock())

    def _usable(self, health: EngineHealth, now: float) -> bool:
        if health.state is EngineState.UP:
            return True
        if health.state is EngineState.OPEN:
            return now - health.opened_at >= self._cooldown
        if health.state is EngineState.HALF_OPEN:
            return now - health.trial_at >= self._cooldown
        return False

    def record_probe(
        self, backend: Backend, ok: bool, detail: str = "", timed_out: bool = False
    ) -> None:
        """A probe's outcome; ``timed_out``: it got no answer in time (as opposed to a
        refused connection or an error status)."""
        with self._lock:
            health = self._engines[backend.url]
            if ok:
                health.probe_failures = 0
                cooled = self._clock() - health.opened_at >= self._cooldown
                if health.state in (EngineState.UNKNOWN, EngineState.DOWN) or (
                    health.state in (EngineState.OPEN, EngineState.HALF_OPEN) and cooled
                ):
                    health.request_failures = 0
                    self._set(health, EngineState.UP)
                return
            busy = self._clock() - health.last_success_at < BUSY_GRACE_S
            if timed_out and busy and health.state is EngineState.UP:
                health.last_error = f"{detail} (not counted: a leg succeeded within the last "
                health.last_error += f"{BUSY_GRACE_S:g} s, so it is busy)"
                return
            health.probe_failures += 1
            health.last_error = detail
            if health.state is EngineState.UNKNOWN or health.probe_failures >= self._eject_after:
                self._set(health, EngineState.DOWN)

    def mark_draining(self, backend: Backend) -> None:
        """The engine answered that it is shutting down: down at once (not a failure of
        the breaker); a later good probe (the engine back, restarted) brings it up."""
        with self._lock:
            health = self._engines[backend.url]
            health.probe_failures = max(health.probe_failures, self._eject_after)
            health.last_error = "draining (shutting down)"
            self._set(health, EngineState.DOWN)

    def record_success(self, backend: Backend) -> None:
        with self._lock:
            health = self._engines[backend.url]
            health.request_failures = 0
            health.last_success_at = self._clock()
            if health.state in (EngineState.HALF_OPEN, EngineState.OPEN):
                self._set(health, EngineState.UP)

    def record_failure(self, backend: Backend, detail: str) -> None:
        with self._lock:
            health = self._engines[backend.url]
            health.request_failures += 1
            health.last_error = detail
            if health.state is EngineState.HALF_OPEN or (
                health.state is EngineState.UP and health.request_failures >= self._open_after
            ):
                health.opened_at = self._clock()
                self._set(health, EngineState.OPEN)

    def leg_started(self, backend: Backend) -> None:
        """A leg goes out now; to a breaker due a trial, it is that trial (half-open)."""
        with self._lock:
            health = self._engines[backend.url]
            health.in_flight += 1
            now = self._clock()
            if health.state in (EngineState.OPEN, EngineState.HALF_OPEN) and self._usable(
                health, now
            ):
                self._set(health, EngineState.HALF_OPEN)
                health.trial_at = now

    def in_flight(self, backend: Backend) -> int:
        """Legs the router has in flight on ``backend`` now."""
        with self._lock:
            return self._engines[backend.url].in_flight

    def leg_ended(self, backend: Backend) -> None:
        with self._lock:
            self._engines[backend.url].in_flight -= 1

    def snapshot(self, backend: Backend) -> dict[str, object]:
        with self._lock:
            health = self._engines[backend.url]
            return {
                "state": health.state.value,
                "up": health.state is EngineState.UP,
                "in_flight": health.in_flight,
                "consecutive_probe_failures": health.probe_failures,
                "consecutive_request_failures": health.request_failures,
                "last_error": health.last_error,
                "state_for_s": round(self._clock() - health.changed_at, 1),
            }
