"""The KV digest protocol over a live ZeroMQ service on 127.0.0.1: digests round-trip
exactly, pending and unknown requests are told apart, and no message — malformed, oversized,
deeply nested, random bytes, wrong types — ends the service or gets anything but an error."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import zmq

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.protocol.digest_wire import (
    MAX_REQUEST_BYTES,
    DigestAskFailed,
    DigestServer,
    GroupDigests,
    ask_digests,
    endpoint_of,
    read_reply,
)

pytestmark = pytest.mark.unit

DIGESTS = {
    0: GroupDigests(
        np.array([4, 5, 9], dtype=np.int64),
        np.array([[1, 2], [2**64 - 1, 0], [7, 2**63]], dtype=np.uint64),
    ),
    2: GroupDigests(np.array([3], dtype=np.int64), np.array([[11, 12]], dtype=np.uint64)),
}


def lookup(req: str):
    return {"ready": DIGESTS, "later": "pending"}.get(req)


@pytest.fixture(scope="module")
def endpoint() -> str:
    port = free_port()
    DigestServer(lookup, "127.0.0.1", port)
    return endpoint_of("127.0.0.1", port)


def raw_ask(endpoint: str, payload: bytes) -> dict | None:
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        socket.send(payload)
        if not socket.poll(3000):
            return None  # dropped (over the size limit): no reply, the service goes on
        return json.loads(socket.recv())
    finally:
        socket.close()


def test_digests_round_trip_exactly(endpoint: str) -> None:
    found = ask_digests(endpoint, "ready", 5.0)
    assert isinstance(found, dict) and set(found) == {0, 2}
    for group, digests in DIGESTS.items():
        assert found[group].of() == digests.of()


def test_pending_and_unknown_are_told_apart(endpoint: str) -> None:
    assert ask_digests(endpoint, "later", 5.0) == "pending"
    assert ask_digests(endpoint, "never-seen", 5.0) is None


def test_no_service_is_a_failure_by_name() -> None:
    with pytest.raises(DigestAskFailed, match="no answer"):
        ask_digests(endpoint_of("127.0.0.1", free_port()), "ready", 0.3)


@pytest.mark.parametrize(
    "reply",
    [
        b"[",
        b"[]",
        b'{"error": "x"}',
        b'{"req": "other", "state": "ready", "groups": {}}',
        b'{"req": "r", "state": "odd"}',
        b'{"req": "r", "state": "ready", "groups": {"0": {"pages": "AA==", "lanes": "AA=="}}}',
        b'{"req": "r", "state": "ready", "groups": {"x": {}}}',
        b"[" * 100000,
    ],
)
def test_every_reply_that_is_not_the_protocol_fails_the_ask(reply: bytes) -> None:
    with pytest.raises(DigestAskFailed):
        read_reply(reply, "r", "the test")


def test_malformed_and_random_messages_get_errors_and_the_service_keeps_serving(
    endpoint: str,
) -> None:
    rng = random.Random(30)
    messages = [
        b"[" * 3000,
        b"{}",
        b"null",
        b'{"op": "pin"}',
        b'{"op": "digest"}',
        b'{"op": "digest", "req": 5}',
        b'{"op": "digest", "req": ""}',
        json.dumps({"op": "digest", "req": "x" * 300}).encode(),
    ]
    messages += [
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(200)
    ]
    for message in messages:
        reply = raw_ask(endpoint, message)
        assert reply is not None and set(reply) == {"error"}, (message[:40], reply)
    assert raw_ask(endpoint, b"x" * (MAX_REQUEST_BYTES + 1)) is None  # dropped unread
    assert ask_digests(endpoint, "ready", 5.0)[2].of() == DIGESTS[2].of()
