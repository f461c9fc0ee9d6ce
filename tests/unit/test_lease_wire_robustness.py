"""No message knocks over the lease service, and no reply knocks over the asking side.

A real ZeroMQ lease service on 127.0.0.1 (the prefill engine's), fed malformed, oversized,
deeply nested and random messages; and a real ZeroMQ peer that answers the asking side
(the decode engine's scheduler) with things that are not the protocol. Time is a test clock
for the table, so nothing here depends on the machine's speed."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from tests.unit.test_router_health import Clock
from vllm_hybrid_nixl.protocol.lease_table import TAKEN_BY_OTHER, LeaseState, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import (
    MAX_IDS,
    MAX_MESSAGE_BYTES,
    LeaseAddress,
    LeaseAskFailed,
    LeaseParamsError,
    LeaseProtocolError,
    LeaseServer,
    ask,
)

pytestmark = pytest.mark.unit


def raw_exchange(address: LeaseAddress, message: bytes, timeout_s: float = 5.0) -> dict | None:
    """Send raw bytes to a lease service; its parsed reply (None when it sent none)."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address.endpoint)
        socket.send(message)
        if not socket.poll(int(timeout_s * 1000)):
            return None
        return json.loads(socket.recv())
    finally:
        socket.close()


@pytest.fixture
def service() -> Iterator[tuple[LeaseServer, LeaseTable]]:
    table = LeaseTable(30, 30, forget_after_s=120, clock=Clock())
    yield LeaseServer(table, "127.0.0.1"), table


def random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([None, True, False, 0, -1, 2**70, 1.5, float("1e308")])
    if kind == 1:
        return "".join(rng.choice('ab\x00\u2603{}[]"') for _ in range(rng.randrange(8)))
    if kind == 2:
        return rng.choice(["pin", "renew", "status", "free", ""])
    if kind == 3:
        return [rng.randrange(3)] * rng.randrange(4)
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["op", "epoch", "reqs", "readers", "x"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_malformed_messages_get_an_error_and_the_service_keeps_serving(service) -> None:
    server, table = service
    table.hold("a")
    epoch = server.address.epoch
    messages = [
        b"[" * 200_000 if 200_000 < MAX_MESSAGE_BYTES else b"[" * (MAX_MESSAGE_BYTES - 1),
        b"[" * 5000 + b"]" * 5000,
        b"\xff\xfe not utf-8",
        b"",
        b"null",
        b"[1, 2]",
        b'"pin"',
        json.dumps({"op": "pin"}).encode(),
        json.dumps({"op": "free", "epoch": epoch, "reqs": ["a"]}).encode(),
        json.dumps({"op": "pin", "epoch": epoch, "reqs": "a"}).encode(),
        json.dumps({"op": "pin", "epoch": epoch, "reqs": [1, 2]}).encode(),
        json.dumps({"op": "pin", "epoch": epoch, "reqs": [["a"]]}).encode(),
        json.dumps({"op": "pin", "epoch": 7, "reqs": ["a"]}).encode(),
        json.dumps({"op": "pin", "epoch": epoch, "reqs": ["a"], "readers": ["x"]}).encode(),
        json.dumps({"op": "pin", "epoch": epoch, "reqs": ["x" * 300]}).encode(),
        json.dumps(
            {"op": "pin", "epoch": epoch, "reqs": [str(i) for i in range(MAX_IDS + 1)]}
        ).encode(),
    ]
    for message in messages:
        reply = raw_exchange(server.address, message)
        assert reply is not None and "error" in reply, (message[:80], reply)
        assert "leases" not in reply
    # Nothing above pinned or released anything, and the service still answers.
    assert table.status("a").state is LeaseState.HELD
    assert ask(server.address, "pin", ["a"])["a"].state is LeaseState.PINNED


def test_a_message_over_the_size_cap_is_dropped_and_the_service_keeps_serving(service) -> None:
    server, table = service
    table.hold("a")
    too_big = b"[" * (MAX_MESSAGE_BYTES + 1)
    assert raw_exchange(server.address, too_big, timeout_s=0.5) is None  # ZeroMQ drops it
    assert ask(server.address, "status", ["a"])["a"].state is LeaseState.HELD


def test_random_messages_never_end_the_service(service) -> None:
    server, table = service
    table.hold("a")
    rng = random.Random(36)
    for _ in range(300):
        message = json.dumps(random_json(rng)).encode()
        reply = raw_exchange(server.address, message)
        assert isinstance(reply, dict) and reply.get("epoch") == server.address.epoch
    assert ask(server.address, "pin", ["a"])["a"].readable


def test_one_reader_per_lease() -> None:
    table = LeaseTable(30, 30, forget_after_s=120, clock=Clock())
    table.hold("p")
    assert table.pin(["p"], {"p": "decode-0/r1"})["p"].state is LeaseState.PINNED
    assert table.pin(["p"], {"p": "decode-0/r1"})["p"].state is LeaseState.PINNED  # renewed
    second = table.pin(["p"], {"p": "decode-1/r2"})["p"]
    assert second.state is LeaseState.TAKEN and second.reason == TAKEN_BY_OTHER
    assert not second.readable
    # The first read's completion frees the blocks; nobody else was let in meanwhile.
    assert table.settle({"p"}) == {"p"}


def test_renewals_keep_a_waiting_lease_and_never_revive_a_released_one() -> None:
    clock = Clock()
    table = LeaseTable(3, 30, forget_after_s=120, clock=clock)
    table.hold("waiting")
    table.hold("forgotten")
    for _ in range(10):  # 20 s of a decode request queued on a busy engine
        clock.now += 2
        table.renew(["waiting"])
        table.settle(set())
    assert table.status("waiting").state is LeaseState.HELD
    assert table.status("forgotten").state is LeaseState.RELEASED
    assert table.renew(["forgotten"])["forgotten"].state is LeaseState.RELEASED


class Impostor:
    """A ZeroMQ REP peer answering every question with ``reply``."""

    def __init__(self, reply: bytes) -> None:
        self.socket = zmq.Context.instance().socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.reply = reply
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                self.socket.recv()
                self.socket.send(self.reply)
            except zmq.ZMQError:
                return


EPOCH = "0123456789abcdef"


@contextmanager
def silent_lease_service() -> Iterator[LeaseAddress]:
    """A ZeroMQ peer on 127.0.0.1 that takes lease questions and never answers; its
    address (epoch :data:`EPOCH`)."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    try:
        yield LeaseAddress("127.0.0.1", silent.bind_to_random_port("tcp://127.0.0.1"), EPOCH)
    finally:
        silent.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"not json",
        b"[" * 100_000,
        b"[]",
        b"42",
        json.dumps({"epoch": EPOCH}).encode(),
        json.dumps({"epoch": EPOCH, "leases": []}).encode(),
        json.dumps({"epoch": EPOCH, "leases": {"r": "held"}}).encode(),
        json.dumps({"epoch": EPOCH, "leases": {"r": {"state": "stolen"}}}).encode(),
        json.dumps({"epoch": EPOCH, "leases": {"r": {"state": "held", "lease_s": "x"}}}).encode(),
        json.dumps({"epoch": EPOCH, "error": "no"}).encode(),
        json.dumps(
            {"epoch": EPOCH, "leases": {"r": {"state": "held", "lease_s": 10**400}}}
        ).encode(),
    ],
)
def test_every_reply_that_is_not_the_protocol_is_a_refusal_not_a_crash(reply: bytes) -> None:
    impostor = Impostor(reply)
    with pytest.raises(LeaseProtocolError):
        ask(LeaseAddress("127.0.0.1", impostor.port, EPOCH), "pin", ["r"], timeout_s=5)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ("tcp://x", "expected an object"),
        ({"host": "127.0.0.1", "port": 0, "epoch": "ab"}, "port"),
        ({"host": "127.0.0.1", "port": 70000, "epoch": "ab"}, "port"),
        ({"host": "127.0.0.1", "port": True, "epoch": "ab"}, "port"),
        ({"host": "127.0.0.1", "port": 5555, "epoch": "not hex"}, "epoch"),
        ({"host": "", "port": 5555, "epoch": "ab"}, "host"),
        ({"host": "a b;c", "port": 5555, "epoch": "ab"}, "host"),
        ({"host": ["x"], "port": 5555, "epoch": "ab"}, "host"),
    ],
)
def test_unusable_lease_params_are_named(params: object, words: str) -> None:
    with pytest.raises(LeaseParamsError, match=words):
        LeaseAddress.parse(params)


def test_an_endpoint_zeromq_cannot_use_is_a_failed_ask() -> None:
    # A host name that parses but does not resolve: ZeroMQ fails at connect.
    address = LeaseAddress("no-such-host.invalid", 5555, EPOCH)
    with pytest.raises(LeaseAskFailed):
        ask(address, "pin", ["r"], timeout_s=0.5)


def test_background_pins_batch_per_endpoint_and_never_raise(service) -> None:
    """The decode engine's pinner: pins to one service go out together and come back as
    statuses; a silent service and an impostor come back as refusals naming why."""
    from vllm_hybrid_nixl.connector.lease_background import LeasePeers, Pinner

    server, table = service
    table.hold("a")
    table.hold("b")
    pinner = Pinner(LeasePeers(), timeout_s=0.5)
    first = pinner.submit(server.address, "a", "decode/1")
    second = pinner.submit(server.address, "b", "decode/2")
    other = pinner.submit(server.address, "a", "decode/3")  # a second reader of "a"
    assert first.result(10).state is LeaseState.PINNED
    assert second.result(10).state is LeaseState.PINNED
    assert other.result(10).state is LeaseState.TAKEN
    with silent_lease_service() as nobody_there:
        nobody = pinner.submit(nobody_there, "x", "decode/4")
        refused = nobody.result(10)
        assert refused.state is LeaseState.UNKNOWN and "no answer" in refused.reason
    impostor = Impostor(b"[]")
    odd = pinner.submit(LeaseAddress("127.0.0.1", impostor.port, EPOCH), "x", "decode/5")
    assert odd.result(10).state is LeaseState.UNKNOWN and "not an object" in odd.result().reason
