"""Pins sent and answered on the decode scheduler's thread (``connector/direct_pin.py``):
a real ZeroMQ lease service on 127.0.0.1 with the real lease table, a real background
pinner behind them, a peer that never answers and peers that answer things that are not
the protocol. The tests wait for answers by polling with deadlines, so a faster or slower
machine passes them alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from tests.unit.test_lease_wire_robustness import EPOCH, Impostor, silent_lease_service
from vllm_hybrid_nixl.connector.direct_pin import DirectPins
from vllm_hybrid_nixl.connector.lease_background import LeasePeers, Pinner
from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import LeaseAddress, LeaseServer

pytestmark = pytest.mark.integration


@pytest.fixture
def service() -> Iterator[tuple[LeaseServer, LeaseTable]]:
    table = LeaseTable(30, 30, forget_after_s=120)
    yield LeaseServer(table, "127.0.0.1"), table


def settled(pins: DirectPins, future: Future[LeaseStatus], within_s: float = 10.0) -> LeaseStatus:
    """Collect (as the scheduler does each step) until ``future`` has its answer."""
    deadline = time.monotonic() + within_s
    while not future.done():
        if time.monotonic() > deadline:
            raise AssertionError("the pin got no answer")
        pins.collect()
        time.sleep(0.002)
    return future.result()


def test_a_pin_leaves_at_once_and_its_answer_waits_for_the_scheduler(service) -> None:
    server, table = service
    table.hold("a")
    peers = LeasePeers()
    pins = DirectPins(60.0, Pinner(peers, 60.0).submit)  # never handed over, however slow
    future = pins.ask(server.address, "a", "decode/1")
    assert future is not None
    deadline = time.monotonic() + 10.0
    while table.status("a").state is not LeaseState.PINNED:  # the question is out
        assert time.monotonic() < deadline, table.status("a")
        time.sleep(0.002)
    time.sleep(0.05)  # however long we wait, no other thread reads the answer
    assert not future.done()
    assert settled(pins, future).state is LeaseState.PINNED
    assert not peers._peers  # no background thread took part


def test_a_second_reader_of_the_same_lease_is_refused(service) -> None:
    server, table = service
    table.hold("b")
    pins = DirectPins(2.0, Pinner(LeasePeers(), 2.0).submit)
    first = pins.ask(server.address, "b", "decode/1")
    assert first is not None and settled(pins, first).state is LeaseState.PINNED
    second = pins.ask(server.address, "b", "decode/2")
    assert second is not None and settled(pins, second).state is LeaseState.TAKEN


def test_one_question_in_flight_per_endpoint() -> None:
    """A second pin to an endpoint whose question is unanswered is not sent (the caller
    pins it in the background); other endpoints are not held up."""
    with silent_lease_service() as first, silent_lease_service() as other:
        pins = DirectPins(60.0, Pinner(LeasePeers(), 60.0).submit)
        assert pins.ask(first, "c", "decode/1") is not None
        assert pins.ask(first, "d", "decode/2") is None
        assert pins.ask(other, "e", "decode/3") is not None
        assert pins.in_flight() == 2


def test_a_question_whose_request_has_gone_is_not_asked_again() -> None:
    with silent_lease_service() as address:
        peers = LeasePeers()
        pins = DirectPins(0.1, Pinner(peers, 0.1).submit)
        future = pins.ask(address, "x", "decode/1")
        pins.abandon(future)
        status = settled(pins, future)
        assert status.state is LeaseState.UNKNOWN and "request gone" in status.reason
        assert not peers._peers  # the background pinner never asked


def test_a_background_pin_that_fails_oddly_still_answers() -> None:
    """The fallback's future ends with an exception: the request gets a refusal, not a wait
    without end."""

    def broken(address: LeaseAddress, remote_req: str, reader: str) -> Future[LeaseStatus]:
        future: Future[LeaseStatus] = Future()
        future.set_exception(RuntimeError("pinner broke"))
        return future

    with silent_lease_service() as address:
        pins = DirectPins(0.1, broken)
        future = pins.ask(address, "x", "decode/1")
        status = settled(pins, future)
        assert status.state is LeaseState.UNKNOWN and "pinner broke" in status.reason


def test_a_silent_service_is_retried_in_the_background_and_refused_by_name() -> None:
    with silent_lease_service() as address:
        pins = DirectPins(0.1, Pinner(LeasePeers(), 0.1).submit)
        future = pins.ask(address, "x", "decode/1")
        assert future is not None
        status = settled(pins, future)
        assert status.state is LeaseState.UNKNOWN
        assert "scheduler's thread: no answer within 0.1 s" in status.reason  # our try
        assert "3 tries" in status.reason  # then the background pinner's
        assert pins.in_flight() == 0 and pins.ask(address, "y", "decode/2") is not None


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (b"not json", "answered something that is not JSON"),
        (b"[]", "answered a list, not an object"),
        (b'{"epoch": "0123456789abcdef", "error": "no"}', "refused the question: no"),
        (
            b'{"epoch": "0123456789abcdef", "leases": {"x": {"state": "stolen"}}}',
            "answered an unusable lease state",
        ),
        (b"x" * 100_000, "no answer within"),  # over the size cap: dropped, never parsed
    ],
)
def test_an_answer_that_is_not_the_protocol_is_a_refusal(reply: bytes, words: str) -> None:
    impostor = Impostor(reply)
    peers = LeasePeers()
    pins = DirectPins(1.0, Pinner(peers, 1.0).submit)
    future = pins.ask(LeaseAddress("127.0.0.1", impostor.port, EPOCH), "x", "decode/1")
    assert future is not None
    status = settled(pins, future)
    assert status.state is LeaseState.UNKNOWN and not status.readable
    assert words in status.reason
    if "no answer" not in words:
        assert not peers._peers  # refused on its answer, not asked again in the background
