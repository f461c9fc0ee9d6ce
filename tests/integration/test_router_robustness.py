"""The router against upstreams it must survive, and what a `/health` call may cost.

The "engines" here are small real HTTP servers on 127.0.0.1 that answer the way a broken or
a slow upstream would (a vLLM engine does not answer 200 with a non-JSON body): the router
under test is the real one (uvicorn, its own event loop)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer
from vllm_hybrid_nixl.router.settings import RouterKeys, UnsafeBindError, refuse_open_router

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


class StubEngine(ThreadingHTTPServer):
    """/health and /v1/models like vLLM; /v1/completions answers ``completion_body``."""

    def __init__(self, completion_body: bytes) -> None:
        self.posts = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _send(handler, body: bytes, kind: str = "application/json") -> None:  # noqa: N805
                handler.send_response(200)
                handler.send_header("Content-Type", kind)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def do_GET(handler) -> None:  # noqa: N805
                if handler.path == "/v1/models":
                    handler._send(
                        json.dumps({"data": [{"id": "m", "max_model_len": 512}]}).encode()
                    )
                else:
                    handler._send(b"")

            def do_POST(handler) -> None:  # noqa: N805
                handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
                stub.posts += 1
                handler._send(completion_body, "text/plain")

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class SilentSideChannel:
    """A TCP port that accepts connections and never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.accepted = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(connection)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"


@pytest.fixture
def broken_prefill() -> Iterator[tuple[RouterServer, StubEngine, StubEngine]]:
    prefill, decode = StubEngine(b"<html>not json</html>"), StubEngine(b"{}")
    router = RouterServer(BackendPool.from_urls([prefill.url], [decode.url])).start()
    yield router, prefill, decode
    router.stop()
    prefill.shutdown()
    decode.shutdown()


def test_a_prefill_answer_that_is_not_json_is_a_clear_502(broken_prefill) -> None:
    """It used to escape as a bare 500 and leave the in-flight gauge up for good."""
    router, prefill, decode = broken_prefill
    body = {"model": "m", "prompt": "p", "max_tokens": 2}
    answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert "no kv_transfer_params" in error["message"] and error["request_id"]
    assert prefill.url not in answer.text  # no internal address to the client
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert "router_in_flight_requests 0.0" in metrics
    assert decode.posts == 0


def test_health_reads_cached_layouts_and_asks_no_side_channel() -> None:
    """N engines with an unanswering side channel cost /health nothing: layouts are read in
    the background, never per call."""
    engines = [StubEngine(b"{}") for _ in range(2)]
    channels = [SilentSideChannel() for _ in range(2)]
    pool = BackendPool.from_urls(
        [engines[0].url], [engines[1].url], [channels[0].address], [channels[1].address]
    )
    router = RouterServer(pool).start()
    try:
        before = [c.accepted for c in channels]
        for _ in range(5):
            assert httpx.get(f"{router.url}/health", timeout=30).status_code in (200, 503)
        assert [c.accepted for c in channels] == before
    finally:
        router.stop()
        for engine in engines:
            engine.shutdown()


@pytest.mark.parametrize("name", ["1p1d.yaml", "2p2d.yaml"])
def test_the_shipped_gpu_configs_refuse_an_open_router_without_a_key(
    name: str, tmp_path: Path
) -> None:
    from vllm_hybrid_nixl.deploy.ray.config import load_config

    (tmp_path / "config.json").write_text("{}")  # the files name a model path of yours
    config = load_config(ROOT / "configs" / "ray" / name, model=str(tmp_path))
    assert config.router_host == "0.0.0.0"
    with pytest.raises(UnsafeBindError):
        refuse_open_router(config.router_host, config.router, RouterKeys())
    refuse_open_router(config.router_host, config.router, RouterKeys(api_key="sk-set"))


def test_the_shipped_cluster_keeps_the_ray_dashboard_on_loopback() -> None:
    text = (ROOT / "configs" / "ray" / "cluster.yaml").read_text()
    assert "--dashboard-host=127.0.0.1" in text and "0.0.0.0" not in text
