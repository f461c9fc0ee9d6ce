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
import zmq

from tests.unit.test_lease_wire_robustness import EPOCH, Impostor
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
    pins = DirectPins(2.0, Pinner(peers, 2.0).submit)
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


def test_one_question_in_flight_per_endpoint_the_next_goes_to_the_background(service) -> None:
    server, table = service
    table.hold("c")
    table.hold("d")
    pinner = Pinner(LeasePeers(), 2.0)
    pins = DirectPins(2.0, pinner.submit)
    first = pins.ask(server.address, "c", "decode/1")
    assert first is not None and pins.in_flight() == 1
    busy = pins.ask(server.address, "d", "decode/2")
    if busy is None:  # the first answer was not in yet: the caller pins in the background
        background = pinner.submit(server.address, "d", "decode/2")
        assert background.result(10).state is LeaseState.PINNED
    else:  # the first answer was already in, collected by ask(): the socket was free
        assert first.done() and settled(pins, busy).state is LeaseState.PINNED
    assert settled(pins, first).state is LeaseState.PINNED
    assert pins.in_flight() == 0


def test_a_silent_service_is_retried_in_the_background_and_refused_by_name() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes questions, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        address = LeaseAddress("127.0.0.1", port, EPOCH)
        pins = DirectPins(0.1, Pinner(LeasePeers(), 0.1).submit)
        future = pins.ask(address, "x", "decode/1")
        assert future is not None
        status = settled(pins, future)
        assert status.state is LeaseState.UNKNOWN and "no answer" in status.reason
        assert "3 tries" in status.reason  # the background pinner's retries, after ours
        assert pins.in_flight() == 0 and pins.ask(address, "y", "decode/2") is not None
    finally:
        silent.close()


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not an object"),
        (b'{"epoch": "0123456789abcdef", "error": "no"}', "no"),
        (b'{"epoch": "0123456789abcdef", "leases": {"x": {"state": "stolen"}}}', ""),
    ],
)
def test_an_answer_that_is_not_the_protocol_is_a_refusal(reply: bytes, words: str) -> None:
    impostor = Impostor(reply)
    pins = DirectPins(2.0, Pinner(LeasePeers(), 2.0).submit)
    future = pins.ask(LeaseAddress("127.0.0.1", impostor.port, EPOCH), "x", "decode/1")
    assert future is not None
    status = settled(pins, future)
    assert status.state is LeaseState.UNKNOWN and not status.readable
    assert words in status.reason
