"""Which engines may pair, as the router and the Ray launcher decide it from side channels.

Each "engine" here is a real ZMQ ROUTER socket on 127.0.0.1 answering NIXL handshake
requests the way vLLM's listener does (msgpack payload with ``compatibility_hash``); the
probe, the pairing table and the launcher's refusal are the real code.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from tests.unit.test_fingerprint import make
from vllm_hybrid_nixl.netutil import free_port
from vllm_hybrid_nixl.ray.deployment import IncompatibleEnginesError, refuse_incompatible_pairs
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.pairing import PairingTable

pytestmark = pytest.mark.unit


class SideChannel:
    """A NIXL-style handshake listener that hands out one compatibility string."""

    def __init__(self, compat: str) -> None:
        self.port = free_port()
        self.compat = compat
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.RCVTIMEO, 100)
        socket.bind(f"tcp://127.0.0.1:{self.port}")
        self._ready.set()
        payload = msgspec.msgpack.encode(
            {"compatibility_hash": self.compat, "agent_metadata_bytes": b""}
        )
        try:
            while not self._stop.is_set():
                try:
                    identity, _, request = socket.recv_multipart()
                except zmq.Again:
                    continue
                assert msgspec.msgpack.decode(request)[0] == b"get_meta_msg"
                socket.send_multipart((identity, b"", payload, msgspec.msgpack.encode(0.0)))
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def channels() -> Iterator[dict[str, SideChannel]]:
    made = {
        "p64": SideChannel(make(block_size=64).encode()),
        "d64": SideChannel(make(block_size=64).encode()),
        "d32": SideChannel(make(block_size=32).encode()),
        "stock": SideChannel("ab" * 32),
    }
    yield made
    for channel in made.values():
        channel.close()


def pool(prefill: list[SideChannel], decode: list[SideChannel]) -> BackendPool:
    return BackendPool.from_urls(
        [f"http://p{i}" for i in range(len(prefill))],
        [f"http://d{i}" for i in range(len(decode))],
        [c.address for c in prefill],
        [c.address for c in decode],
    )


def test_equal_layouts_pair(channels) -> None:
    engines = pool([channels["p64"]], [channels["d64"]])
    table = PairingTable(engines.all(), timeout_s=2)
    table.refresh()
    assert table.problems(engines.prefill, engines.decode) == []
    assert "block_size=64" in table.layout(engines.prefill[0]).summary()
    refuse_incompatible_pairs(engines)  # no refusal


def test_different_block_sizes_are_refused_with_both_values(channels) -> None:
    engines = pool([channels["p64"]], [channels["d64"], channels["d32"]])
    table = PairingTable(engines.all(), timeout_s=2)
    table.refresh()
    (problem,) = table.problems(engines.prefill, engines.decode)
    assert "groups[0].block_size: decode-1 32, prefill-0 64" in problem
    assert engines.next_pair(table.problem)[1].url == "http://d0"  # the compatible one
    assert engines.next_pair(table.problem)[1].url == "http://d0"
    with pytest.raises(IncompatibleEnginesError, match="groups\\[0\\].block_size"):
        refuse_incompatible_pairs(engines)


def test_stock_connector_peer_is_named(channels) -> None:
    engines = pool([channels["stock"]], [channels["d64"]])
    table = PairingTable(engines.all(), timeout_s=2)
    table.refresh()
    (problem,) = table.problems(engines.prefill, engines.decode)
    assert "prefill engine prefill-0 runs vLLM's stock NixlConnector" in problem


def test_silent_side_channel_leaves_the_layout_unknown_not_refused(channels) -> None:
    engines = pool([channels["p64"]], [channels["d64"]])
    dead = dataclasses.replace(engines.decode[0], side_channel=f"127.0.0.1:{free_port()}")
    table = PairingTable([engines.prefill[0], dead], timeout_s=0.5)
    table.refresh()
    layout = table.layout(dead)
    assert not layout.known and "did not answer" in layout.error
    assert table.problem(engines.prefill[0], dead) == ""
    assert table.needs_probe() is False  # retried only after retry_after_s
