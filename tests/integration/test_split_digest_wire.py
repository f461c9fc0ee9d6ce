"""Split digest questions on the wire, over a live digest service on 127.0.0.1: a malformed
``split`` is an error for that request and the service goes on; a reply that ignores the
split asked (an older prefill) or names ``unsplit`` for a group not asked as a part is never
compared as if it were the part. Not in the version matrix: no vLLM is involved."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_digest_wire import DIGESTS, lookup, raw_ask
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.protocol.digest_wire import DigestAskFailed, DigestServer, endpoint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def endpoint() -> str:
    port = free_port()
    DigestServer(lookup, "127.0.0.1", port)
    return endpoint_of("127.0.0.1", port)


@pytest.mark.parametrize(
    "split",
    [
        [],
        {"0": [2, 2, 1]},
        {"0": [0, 0, 1]},
        {"x": [2, 0, 1]},
        {"0": [2, 0]},
        {"0": [True, 0, 1]},
        {"0": [2, 0, 10**9]},
        {str(g): [2, 0, 1] for g in range(65)},
    ],
)
def test_a_malformed_split_is_an_error_for_that_request(endpoint: str, split) -> None:
    reply = raw_ask(endpoint, json.dumps({"op": "digest", "req": "ready", "split": split}).encode())
    assert reply is not None and reply.get("req") == "ready" and "split" in reply["error"]
    assert raw_ask(endpoint, b'{"op": "digest", "req": "ready"}')["state"] == "ready"


def test_a_reply_that_ignores_the_split_asked_is_unverifiable_not_compared() -> None:
    """A prefill of a release without split digests answers whole pages to a split
    question: comparing those with a decode rank's part would fail every read, so the group
    is marked unverifiable; a reply that names the part it answered is used."""
    from vllm_hybrid_nixl.protocol.digest_wire import read_parsed

    whole = {"req": "r", "state": "ready", "groups": {"0": DIGESTS[0].to_wire()}}
    found = read_parsed(whole, "r", "test", {0: (2, 1, 2)})
    assert "answered whole pages" in found[0].unverifiable
    named = {**whole, "split": {"0": [2, 1, 2]}}
    assert read_parsed(named, "r", "test", {0: (2, 1, 2)})[0].of() == DIGESTS[0].of()
    other = {**whole, "split": {"0": [2, 0, 2]}}  # another part than asked
    assert read_parsed(other, "r", "test", {0: (2, 1, 2)})[0].unverifiable
    assert read_parsed(whole, "r", "test")[0].of() == DIGESTS[0].of()  # no split asked


def test_unsplit_is_honoured_only_for_a_group_asked_as_a_part() -> None:
    """A prefill cannot turn a group it was asked whole (or answered with digests) into an
    unverified one: such a reply is not the protocol."""
    from vllm_hybrid_nixl.protocol.digest_wire import read_parsed

    reply = {"req": "r", "state": "ready", "groups": {}, "unsplit": {"0": "no"}}
    with pytest.raises(DigestAskFailed, match="unsplit but was not asked"):
        read_parsed(reply, "r", "test")
    both = {**reply, "groups": {"0": DIGESTS[0].to_wire()}}
    with pytest.raises(DigestAskFailed, match="unsplit but was not asked"):
        read_parsed(both, "r", "test", {0: (2, 0, 1)})
    assert read_parsed(reply, "r", "test", {0: (2, 0, 1)})[0].unverifiable == "no"
