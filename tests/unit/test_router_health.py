"""The router's per-engine health state machine and engine choice (pure, injected clock)."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.health import EngineState, HealthTracker

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    pool = BackendPool.from_urls(["http://p0", "http://p1"], ["http://d0"])
    clock = Clock()
    tracker = HealthTracker(
        pool.all(),
        probe_failures_to_eject=2,
        request_failures_to_open=3,
        open_cooldown_s=10,
        clock=clock,
    )
    return pool, tracker, clock


def test_engines_take_no_traffic_until_a_probe_answers(setup) -> None:
    pool, tracker, _ = setup
    p0 = pool.prefill[0]
    assert tracker.state(p0) is EngineState.UNKNOWN and not tracker.usable(p0)
    tracker.record_probe(p0, False, "refused")
    assert tracker.state(p0) is EngineState.DOWN  # an engine never seen up is down at once
    tracker.record_probe(p0, True)
    assert tracker.usable(p0)


def test_failed_probes_in_a_row_eject_and_one_success_brings_back(setup) -> None:
    pool, tracker, _ = setup
    p0 = pool.prefill[0]
    tracker.record_probe(p0, True)
    tracker.record_probe(p0, False, "timeout")
    assert tracker.usable(p0)  # one failure is tolerated
    tracker.record_probe(p0, True)
    tracker.record_probe(p0, False, "timeout")
    assert tracker.usable(p0)  # the count restarted
    tracker.record_probe(p0, False, "refused")
    assert tracker.state(p0) is EngineState.DOWN and not tracker.usable(p0)
    assert tracker.snapshot(p0)["last_error"] == "refused"
    tracker.record_probe(p0, True)
    assert tracker.state(p0) is EngineState.UP


def test_breaker_opens_after_failed_legs_and_half_opens_after_cooldown(setup) -> None:
    pool, tracker, clock = setup
    d0 = pool.decode[0]
    tracker.record_probe(d0, True)
    for _ in range(2):
        tracker.record_failure(d0, "HTTP 500")
    tracker.record_success(d0)  # a success in between resets the count
    for _ in range(3):
        tracker.record_failure(d0, "HTTP 500")
    assert tracker.state(d0) is EngineState.OPEN and not tracker.usable(d0)
    tracker.record_probe(d0, True)  # a probe inside the cooldown does not close it
    assert tracker.state(d0) is EngineState.OPEN
    clock.now += 9.9
    assert not tracker.usable(d0)
    clock.now += 0.2
    assert tracker.usable(d0) and tracker.usable(d0)  # looking changes nothing
    assert tracker.state(d0) is EngineState.OPEN
    tracker.leg_started(d0)  # the trial leg
    assert tracker.state(d0) is EngineState.HALF_OPEN and not tracker.usable(d0)
    tracker.record_failure(d0, "HTTP 500")  # the trial failed: open again, new cooldown
    tracker.leg_ended(d0)
    assert tracker.state(d0) is EngineState.OPEN
    clock.now += 10
    assert tracker.usable(d0)
    tracker.leg_started(d0)
    tracker.record_success(d0)
    assert tracker.state(d0) is EngineState.UP


def tripped(tracker: HealthTracker, pool: BackendPool, clock: Clock):
    """The decode engine, up, then its breaker opened by 3 failed legs, the cooldown over."""
    d0 = pool.decode[0]
    tracker.record_probe(d0, True)
    for _ in range(3):
        tracker.record_failure(d0, "HTTP 500")
    clock.now += 11
    return d0


def test_a_lookup_that_records_no_outcome_never_strands_an_engine(setup) -> None:
    """``/v1/models`` asks ``usable`` and sends nothing through the breaker: the engine
    must still get its trial leg."""
    pool, tracker, clock = setup
    d0 = tripped(tracker, pool, clock)
    for _ in range(5):
        assert tracker.usable(d0)  # lookups
    tracker.leg_started(d0)
    tracker.record_success(d0)
    assert tracker.state(d0) is EngineState.UP


def test_an_abandoned_trial_admits_another_after_the_cooldown(setup) -> None:
    """A trial leg cancelled by a client disconnect records no outcome."""
    pool, tracker, clock = setup
    d0 = tripped(tracker, pool, clock)
    tracker.leg_started(d0)
    tracker.leg_ended(d0)  # cancelled: neither success nor failure
    assert not tracker.usable(d0)
    clock.now += 10
    assert tracker.usable(d0)


def test_a_good_probe_after_the_cooldown_brings_an_open_engine_back(setup) -> None:
    """With one decode engine and no traffic able to reach it, probes must close it."""
    pool, tracker, clock = setup
    d0 = tripped(tracker, pool, clock)
    tracker.leg_started(d0)  # a trial that never reports
    tracker.record_probe(d0, True)
    assert tracker.state(d0) is EngineState.UP and tracker.usable(d0)


def test_in_flight_is_counted_per_engine(setup) -> None:
    pool, tracker, _ = setup
    p1 = pool.prefill[1]
    tracker.leg_started(p1)
    tracker.leg_started(p1)
    tracker.leg_ended(p1)
    assert tracker.snapshot(p1)["in_flight"] == 1
    assert tracker.snapshot(pool.prefill[0])["in_flight"] == 0


def test_pick_rotates_skips_unusable_and_excluded(setup) -> None:
    pool, _, _ = setup
    p0, p1 = pool.prefill
    assert [pool.pick("prefill", lambda b: True) for _ in range(3)] == [p0, p1, p0]
    assert {pool.pick("prefill", lambda b: b is not p0) for _ in range(3)} == {p1}
    assert pool.pick("prefill", lambda b: True, exclude=[p0, p1]) is None
    assert pool.pick("decode", lambda b: False) is None


def test_probe_timeouts_do_not_eject_an_engine_that_just_answered_a_leg(setup) -> None:
    """A busy engine (its /health slow, its legs answered) stays in rotation; a refused
    connection still counts, and so do timeouts once no leg succeeded for the grace."""
    pool, tracker, clock = setup
    d0 = pool.decode[0]
    tracker.record_probe(d0, True)
    tracker.record_success(d0)
    for _ in range(5):
        tracker.record_probe(d0, False, "/health: ReadTimeout", timed_out=True)
    assert tracker.state(d0) is EngineState.UP and tracker.usable(d0)
    assert "busy" in str(tracker.snapshot(d0)["last_error"])
    tracker.record_probe(d0, False, "/health: ConnectError")
    tracker.record_probe(d0, False, "/health: ConnectError")
    assert tracker.state(d0) is EngineState.DOWN


def test_probe_timeouts_eject_an_engine_silent_past_the_grace(setup) -> None:
    from vllm_hybrid_nixl.router.health import BUSY_GRACE_S

    pool, tracker, clock = setup
    d0 = pool.decode[0]
    tracker.record_probe(d0, True)
    tracker.record_success(d0)
    clock.now += BUSY_GRACE_S + 1
    tracker.record_probe(d0, False, "/health: ReadTimeout", timed_out=True)
    tracker.record_probe(d0, False, "/health: ReadTimeout", timed_out=True)
    assert tracker.state(d0) is EngineState.DOWN
