"""Which engines may pair, as the router and the Ray launcher decide it from side channels.

Each "engine" here is a real ZMQ ROUTER socket on 127.0.0.1 answering NIXL handshake
requests the way vLLM's listener does (msgpack payload with ``compatibility_hash``); the
probe, the pairing table and the launcher's refusal are the real code.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import zmq

from tests.unit.test_fingerprint import make
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.ray.deployment import (
    IncompatibleEnginesError,
    refuse_incompatible_pairs,
)
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.pairing import PairingTable

pytestmark = pytest.mark.unit


class SideChannel:
    """A NIXL-style handshake listener that hands out one compatibility string, beside an
    HTTP ``/version`` naming the engine's vLLM release (``None``: no answer there). It
    records every request form it was sent."""

    def __init__(self, compat: str, release: str | None = "0.32.0+cpu") -> None:
        self.port = free_port()
        self.compat = compat
        self.requests: list[tuple] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(5)
        self.http = _VersionServer(release)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.server_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.RCVTIMEO, 100)
        socket.bind(f"tcp://127.0.0.1:{self.port}")
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    identity, _, request = socket.recv_multipart()
                except zmq.Again:
                    continue
                decoded = tuple(msgspec.msgpack.decode(request))
                self.requests.append(decoded)
                assert decoded[0] == b"get_meta_msg"
                payload = msgspec.msgpack.encode(
                    {"compatibility_hash": self.compat, "agent_metadata_bytes": b""}
                )
                socket.send_multipart((identity, b"", payload, msgspec.msgpack.encode(0.0)))
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.http.shutdown()
        self.http.server_close()


class _VersionServer(ThreadingHTTPServer):
    def __init__(self, release: str | None) -> None:
        self.release = release

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N805
                if handler.path != "/version" or self.release is None:
                    handler.send_error(404)
                    return
                body = json.dumps({"version": self.release}).encode()
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


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
        [c.url for c in prefill],
        [c.url for c in decode],
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
    assert engines.next_pair(table.problem)[1] == engines.decode[0]  # the compatible one
    assert engines.next_pair(table.problem)[1] == engines.decode[0]
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


@pytest.mark.parametrize(("release", "form_length"), [("0.25.1+cpu", 2), ("0.32.0", 3)])
def test_the_side_channel_is_asked_in_the_engine_releases_form(release, form_length) -> None:
    """(msg, tp_rank) for 0.24-0.25 engines, (msg, pp_rank, tp_rank) after: the form comes
    from the engine's /version, never from the router's own vLLM."""
    prefill = SideChannel(make(block_size=64).encode(), release=release)
    decode = SideChannel(make(block_size=64).encode(), release=release)
    try:
        engines = pool([prefill], [decode])
        table = PairingTable(engines.all(), timeout_s=2)
        table.refresh()
        assert table.problems(engines.prefill, engines.decode) == []
        assert [len(r) for r in prefill.requests] == [form_length]
    finally:
        prefill.close()
        decode.close()


def test_an_engine_whose_release_is_unknown_is_never_sent_a_form() -> None:
    silent = SideChannel(make(block_size=64).encode(), release=None)
    try:
        engines = pool([silent], [])
        table = PairingTable(engines.all(), timeout_s=1)
        table.refresh()
        assert silent.requests == []
        assert "/version" in table.layout(engines.prefill[0]).error
    finally:
        silent.close()


def test_a_fingerprint_of_a_newer_protocol_is_refused_by_name(channels) -> None:
    newer = SideChannel("hybrid-nixl/2:abcd:not-our-encoding")
    try:
        engines = pool([newer], [channels["d64"]])
        table = PairingTable(engines.all(), timeout_s=2)
        table.refresh()
        (problem,) = table.problems(engines.prefill, engines.decode)
        assert "layout protocol '2'" in problem and "reads protocol 1" in problem
    finally:
        newer.close()


def test_a_cached_verdict_follows_an_engine_whose_layout_changed(channels) -> None:
    """Verdicts are cached per pair (every leg asks); a refresh that reads another layout
    (the decode engine restarted with another block size) must change the answer."""
    engines = pool([channels["p64"]], [channels["d64"]])
    table = PairingTable(engines.all(), timeout_s=2)
    table.refresh()
    prefill, decode = engines.prefill[0], engines.decode[0]
    assert table.problem(prefill, decode) == "" and table.problem(prefill, decode) == ""
    channels["d64"].compat = make(block_size=32).encode()
    table.refresh()
    assert "groups[0].block_size: decode-0 32, prefill-0 64" in table.problem(prefill, decode)
    channels["d64"].compat = make(block_size=64).encode()
    table.refresh()
    assert table.problem(prefill, decode) == ""
