"""The check after a read: a decode request's KV read counts only if it completed while its
prefill engine surely still held the blocks (issue 36, item 3).

The hold comes from acknowledged pins and renewals of a real lease service on 127.0.0.1 (real
ZeroMQ, the real lease table); the worker's check runs on vLLM's own transfer-results class.
A read that outlasts its hold on real engines needs a prefill engine that stops answering in
the middle of a millisecond-long read, which no test here can time; the pieces that decide it
are tested with a clock the test moves instead."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.unit.test_router_health import Clock
from vllm_hybrid_nixl.connector.lease import LeaseHolderMixin, RemoteKv
from vllm_hybrid_nixl.connector.lease_background import LeasePeers, LeaseRenewer
from vllm_hybrid_nixl.connector.read_holds import (
    CROSS_HOST_MARGIN_S,
    ReadHolds,
    holds_payload,
    late_read_message,
)
from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import PARAMS_KEY, LeaseServer

pytestmark = pytest.mark.integration


def holds(clock: Clock, boot: str = "this-boot") -> ReadHolds:
    return ReadHolds(clock, boot=boot)


def payload(clock: Clock, until: dict, lost=(), boot: str = "this-boot") -> dict:
    return {**holds_payload(until, lost, now=clock.now), "boot": boot}


def test_a_read_completed_past_its_hold_is_late_and_one_within_it_is_not() -> None:
    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"early": clock.now + 5, "late": clock.now + 5, "failed": 0.0}))
    clock.now += 4.0
    assert view.late_reads({"early"}, set()) == {}
    clock.now += 2.0
    assert view.late_reads({"late", "failed", "never-held"}, {"failed"}) == {"late": 1.0}
    assert view.late_reads({"late"}, set()) == {}  # checked once


def test_a_renewal_during_the_read_extends_its_hold() -> None:
    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"r": clock.now + 2}))
    clock.now += 1.5
    view.update(payload(clock, {"r": clock.now + 3}))  # next step: a renewal was acknowledged
    clock.now += 2.5
    assert view.late_reads({"r"}, set()) == {}


def test_a_release_reported_during_the_read_fails_it_whatever_its_deadline() -> None:
    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"r": clock.now + 30}, lost=["r"]))
    assert view.late_reads({"r"}, set()) == {"r": float("inf")}
    assert "answered a lease renewal that the blocks were released" in late_read_message(
        "r", float("inf")
    )


def test_each_payload_replaces_the_view_so_nothing_stays_behind() -> None:
    """Under asynchronous scheduling a finished read's hold can arrive once more after the
    worker checked it; the next payload (without it) drops it, and no payload clears all."""
    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"a": clock.now + 1, "b": clock.now + 1}))
    view.update(payload(clock, {"b": clock.now + 1}))
    clock.now += 5
    assert view.late_reads({"a", "b"}, set()) == {"b": 4.0}
    view.update(payload(clock, {"c": clock.now + 1}))
    view.update(None)
    clock.now += 5
    assert view.late_reads({"c"}, set()) == {}


def test_a_hold_from_another_host_is_converted_with_a_margin() -> None:
    """Another boot's monotonic clock means nothing here: the deadline is taken relative to
    the payload's build time, less the cross-host margin."""
    scheduler, worker = Clock(), Clock()
    worker.now = 5000.0
    view = holds(worker, boot="worker-boot")
    view.update(payload(scheduler, {"r": scheduler.now + 10}, boot="scheduler-boot"))
    worker.now += 10 - CROSS_HOST_MARGIN_S - 0.1
    assert view.late_reads({"r"}, set()) == {}
    view.update(payload(scheduler, {"r": scheduler.now + 10}, boot="scheduler-boot"))
    worker.now += 10 - CROSS_HOST_MARGIN_S + 0.1
    assert view.late_reads({"r"}, set()) == {"r": pytest.approx(0.1)}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "5", True, None, [1]])
def test_a_hold_that_is_not_a_finite_number_is_ignored(value: object) -> None:
    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"r": value}))
    clock.now += 1000
    assert view.late_reads({"r"}, set()) == {}


@pytest.mark.parametrize("value", [None, [], "x", {"until": "x", "lost": "r"}, {"lost": 3}])
def test_a_payload_of_another_shape_checks_nothing_and_never_raises(value: object) -> None:
    clock = Clock()
    view = holds(clock)
    view.update(value)
    assert view.late_reads({"r"}, set()) == {}


def test_late_reads_become_failed_loads_in_vllms_transfer_results() -> None:
    """The worker adds a late read to ``failed_recving`` (it is in ``finished_recving``
    already), which makes vLLM recompute or fail it instead of caching its blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    clock = Clock()
    view = holds(clock)
    view.update(payload(clock, {"a": clock.now + 1, "b": clock.now + 10}))
    clock.now += 2.0
    results = KVConnectorTransferResults(finished_recving={"a", "b"})
    for req_id in view.late_reads(results.finished_recving, results.failed_recving):
        results.failed_recving.add(req_id)
    assert results.failed_recving == {"a"}
    assert results.finished_recving == {"a", "b"}


@pytest.fixture
def service() -> Iterator[tuple[LeaseServer, LeaseTable]]:
    table = LeaseTable(lease_s=4.0, pin_s=8.0, forget_after_s=120)
    yield LeaseServer(table, "127.0.0.1"), table  # a daemon thread, as in the engine


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_acknowledged_renewals_bound_the_hold_from_below(service) -> None:
    server, table = service
    table.hold("p1")
    renewer = LeaseRenewer(LeasePeers(), timeout_s=2.0)
    before = time.monotonic()
    renewer.add("d1", server.address, "p1", table.lease_s)
    held = wait_for(lambda: renewer.held_until("d1"))
    assert before + table.lease_s <= held <= time.monotonic() + table.lease_s
    later = wait_for(lambda: (renewer.held_until("d1") or 0) > held and renewer.held_until("d1"))
    assert later > held  # every round moves it on while the request waits
    renewer.drop("d1")
    assert renewer.held_until("d1") is None


def test_a_released_lease_never_extends_the_hold(service) -> None:
    server, table = service
    table.hold("p1")
    table.settle({"p1"})  # read by someone, freed
    renewer = LeaseRenewer(LeasePeers(), timeout_s=2.0)
    renewer.add("d1", server.address, "p1", table.lease_s)
    wait_for(lambda: renewer.lost("d1"))
    assert renewer.lost("d1")  # a peek: the scheduler still takes it
    assert renewer.take_lost("d1").state is LeaseState.RELEASED
    assert renewer.held_until("d1") is None


def test_the_prefill_engine_says_how_long_a_pin_holds(service) -> None:
    """``pin_s`` travels in the lease value; a value that is not a usable duration leaves
    the hold unknown (checked by renewals only) instead of trusted."""
    server, _ = service
    lease = {**server.address.to_params(), "lease_s": 4.0, "pin_s": 8.0}

    def remote(value: dict) -> RemoteKv | None:
        request = type("Request", (), {})()
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "remote_request_id": "p1",
            "remote_engine_id": "e1",
            PARAMS_KEY: value,
        }
        holder = LeaseHolderMixin.__new__(LeaseHolderMixin)
        holder._warned_unguarded = True
        return holder._lease_of(request)

    assert remote(lease).pin_s == 8.0
    for bad in (-1, float("nan"), float("inf"), "8", True):
        assert remote({**lease, "pin_s": bad}).pin_s is None
    assert remote({k: v for k, v in lease.items() if k != "pin_s"}).pin_s is None
