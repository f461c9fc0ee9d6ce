"""The prefill engine's lease table and its wire protocol (a real ZeroMQ server on
127.0.0.1); time is a test clock, so nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest

from tests.unit.test_router_health import Clock
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.protocol.lease_table import EXPIRED, PIN_EXPIRED, READ, LeaseState, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import (
    RESTARTED,
    LeaseAddress,
    LeaseServer,
    LeaseUnreachable,
    ask,
)

pytestmark = pytest.mark.unit


def table(clock: Clock, lease_s: float = 3, pin_s: float = 30) -> LeaseTable:
    return LeaseTable(lease_s, pin_s, forget_after_s=120, clock=clock)


def test_a_read_within_the_lease_frees_the_blocks_once() -> None:
    clock = Clock()
    leases = table(clock)
    leases.hold("r")
    assert leases.pin(["r"])["r"].state is LeaseState.PINNED
    assert leases.settle({"r"}) == {"r"}
    assert leases.status("r").state is LeaseState.RELEASED and leases.status("r").reason == READ
    assert leases.settle({"r"}) == set()  # vLLM's own late report of the same request


def test_an_unpinned_lease_expires_and_is_freed_by_the_table_itself() -> None:
    clock = Clock()
    leases = table(clock)
    leases.hold("r")
    clock.now += 2.9
    assert leases.settle(set()) == set()
    clock.now += 0.2
    assert leases.settle(set()) == {"r"}
    clock.now += 5
    refused = leases.pin(["r"])["r"]
    assert refused.state is LeaseState.RELEASED and refused.reason == EXPIRED
    assert refused.released_ago_s == pytest.approx(5)
    assert leases.settle({"r"}) == set()  # the stock worker's report after ours


def test_a_pin_after_the_deadline_is_refused_even_before_settling() -> None:
    clock = Clock()
    leases = table(clock)
    leases.hold("r")
    clock.now += 3.5
    assert not leases.pin(["r"])["r"].readable
    assert leases.settle(set()) == {"r"}


def test_a_pinned_lease_outlives_the_lease_until_the_pin_runs_out() -> None:
    clock = Clock()
    leases = table(clock)
    leases.hold("r")
    clock.now += 2
    assert leases.pin(["r"])["r"].readable
    clock.now += 10  # past the 3 s lease, inside the 30 s pin
    assert leases.settle(set()) == set() and leases.status("r").readable
    clock.now += 25
    assert leases.settle(set()) == {"r"}
    assert leases.status("r").reason == PIN_EXPIRED


def test_requests_the_table_never_held_pass_through() -> None:
    leases = table(Clock())
    assert leases.settle({"not-ours"}) == {"not-ours"}
    assert leases.status("not-ours").state is LeaseState.UNKNOWN


def test_releases_are_remembered_for_forget_after_s() -> None:
    clock = Clock()
    leases = table(clock)
    leases.hold("old")
    leases.settle({"old"})
    clock.now += 121
    leases.hold("new")
    leases.settle({"new"})
    assert leases.status("old").state is LeaseState.UNKNOWN
    assert leases.status("new").state is LeaseState.RELEASED


def test_the_wire_pins_reports_and_detects_a_restart() -> None:
    clock = Clock()
    leases = table(clock)
    server = LeaseServer(leases, "127.0.0.1")
    leases.hold("a")
    answers = ask(server.address, "pin", ["a", "b"])
    assert answers["a"].state is LeaseState.PINNED
    assert answers["b"].state is LeaseState.UNKNOWN
    restarted = LeaseServer(table(clock), "127.0.0.1")  # a new start: another epoch
    stale = LeaseAddress("127.0.0.1", restarted.address.port, server.address.epoch)
    answer = ask(stale, "status", ["a"])["a"]
    assert answer.state is LeaseState.UNKNOWN and answer.reason == RESTARTED


def test_an_engine_that_does_not_answer_is_reported_in_bounded_time() -> None:
    nobody = LeaseAddress("127.0.0.1", free_port(), "0")
    with pytest.raises(LeaseUnreachable, match="no answer"):
        ask(nobody, "pin", ["a"], timeout_s=0.2)


@pytest.mark.parametrize(
    "params", [None, {}, {"host": "h"}, {"host": "h", "port": "x", "epoch": 1}]
)
def test_malformed_lease_params_are_ignored(params: object) -> None:
    assert LeaseAddress.from_params(params) is None
