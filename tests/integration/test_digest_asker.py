"""The decode worker's non-blocking digest questions against a live digest service on
127.0.0.1: answers collected by polling, pending ones asked again until they are ready, a
silent endpoint failing by its deadline, a reply that is not the protocol ignored."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.protocol.digest_wire import (
    DigestAsker,
    DigestAskFailed,
    DigestServer,
    GroupDigests,
    endpoint_of,
)

pytestmark = pytest.mark.integration

READY = {0: GroupDigests(np.array([3, 4], dtype=np.int64), np.ones((2, 2), np.uint64))}


def poll_until(asker: DigestAsker, endpoint: str, req: str, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        asker.poll()
        found = asker.answer(endpoint, req)
        if found is not None:
            return found
        time.sleep(0.005)
    raise AssertionError("no answer")


def test_an_answer_is_collected_by_polling_and_pending_is_asked_again() -> None:
    ready_after = time.monotonic() + 0.3
    port = free_port()
    DigestServer(lambda r: READY if time.monotonic() > ready_after else None, "127.0.0.1", port)
    endpoint = endpoint_of("127.0.0.1", port)
    asker = DigestAsker()
    asker.ask(endpoint, "req-1", time.monotonic() + 10)
    found = poll_until(asker, endpoint, "req-1")
    assert found[0].of() == READY[0].of()
    assert time.monotonic() >= ready_after  # asked again until it was ready
    asker.close()


def test_a_silent_endpoint_fails_by_its_deadline_naming_it() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes questions, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = endpoint_of("127.0.0.1", port)
    asker = DigestAsker()
    asker.ask(endpoint, "req-2", time.monotonic() + 0.3)
    with pytest.raises(DigestAskFailed, match=f"127.0.0.1:{port}"):
        poll_until(asker, endpoint, "req-2")
    asker.close()
    silent.close()


def test_a_reply_that_is_not_the_protocol_is_ignored_until_the_deadline() -> None:
    liar = zmq.Context.instance().socket(zmq.ROUTER)
    liar.setsockopt(zmq.LINGER, 0)
    port = liar.bind_to_random_port("tcp://127.0.0.1")
    endpoint = endpoint_of("127.0.0.1", port)
    asker = DigestAsker()
    asker.ask(endpoint, "req-3", time.monotonic() + 0.5)
    frames = liar.recv_multipart()
    liar.send_multipart([frames[0], b"", b"[" * 5000])
    liar.send_multipart([frames[0], b"", b'{"req": "req-3", "state": "ready", "groups": 7}'])
    with pytest.raises(DigestAskFailed):
        poll_until(asker, endpoint, "req-3")
    asker.close()
    liar.close()


def test_a_failed_question_is_asked_again_by_a_later_deadline() -> None:
    """A question sent as a read started that failed (the service was down) must not fail the
    check made when the read completes: that one asks again."""
    port = free_port()
    endpoint = endpoint_of("127.0.0.1", port)
    asker = DigestAsker()
    asker.ask(endpoint, "req-4", time.monotonic() + 0.2)
    time.sleep(0.3)
    asker.poll()  # the first question is failed now, and kept as such
    DigestServer(lambda r: READY, "127.0.0.1", port)
    asker.ask(endpoint, "req-4", time.monotonic() + 10)
    assert poll_until(asker, endpoint, "req-4")[0].of() == READY[0].of()
    asker.close()


def test_a_split_question_gets_the_part_of_each_page_or_says_why_not() -> None:
    """A decode rank of twice the prefill's TP asks for part 1 of 2 of group 0 (kept per
    cell: 2 regions x 4 cells) and of group 1 (digested whole): it gets group 0's lanes of
    that part (the sum of cells 2..3 of both regions) and, for group 1, why not."""
    cells = np.arange(2 * 2 * 4 * 2, dtype=np.uint64).reshape(2, 2, 4, 2) * np.uint64(2**61)
    pages = np.array([7, 8], dtype=np.int64)
    whole = GroupDigests(np.array([1], dtype=np.int64), np.ones((1, 2), np.uint64))
    kept = {0: GroupDigests(pages, cells.sum(axis=(1, 2), dtype=np.uint64), cells), 1: whole}
    port = free_port()
    DigestServer(lambda r: kept if r == "req-split" else None, "127.0.0.1", port)
    endpoint = endpoint_of("127.0.0.1", port)
    asker = DigestAsker()
    asker.ask(endpoint, "req-split", time.monotonic() + 10, {0: (2, 1, 2), 1: (2, 1, 1)})
    found = poll_until(asker, endpoint, "req-split")
    with np.errstate(over="ignore"):
        expected = cells[:, :, 2:4, :].sum(axis=(1, 2), dtype=np.uint64)
    assert np.array_equal(found[0].pages, pages)
    assert np.array_equal(found[0].lanes, expected)
    assert not np.array_equal(found[0].lanes, kept[0].lanes)
    assert "digested whole" in found[1].unverifiable and found[1].pages.size == 0
    # a part the cells cannot give (3 parts of 4 cells), and regions that differ
    asker.ask(endpoint, "req-split", time.monotonic() + 10, {0: (3, 0, 2)})
    assert "does not fall on 4 cells" in poll_until(asker, endpoint, "req-split")[0].unverifiable
    asker.ask(endpoint, "req-split", time.monotonic() + 10, {0: (2, 0, 3)})
    assert "regions" in poll_until(asker, endpoint, "req-split")[0].unverifiable
    asker.close()
