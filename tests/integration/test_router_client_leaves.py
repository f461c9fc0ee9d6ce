"""A client that leaves while its legs run: the real router (uvicorn on 127.0.0.1) closes the
leg's connection, so the engine aborts the request, counts the client as gone, returns the
engine's in-flight count and serves the next request. The legs run in the request's own
task (``completions.unless_client_leaves``), so the client's leaving has to cancel that
task and nothing else.

The engine is a small real HTTP server that holds a prefill leg until its connection
closes (as a long prefill would), then answers later legs at once."""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from vllm_hybrid_nixl.deploy.metrics_text import sample_sum
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.integration

BODY = {"model": "m", "prompt": "p", "max_tokens": 2, "temperature": 0.0}


class HoldingEngine(ThreadingHTTPServer):
    """/health and /v1/models like vLLM. While ``hold`` is set a POST is held until its
    connection closes (``aborted`` is then set); otherwise it is answered at once, a
    prefill leg with KV transfer parameters, a decode leg with a completion."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.aborted = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(handler, body: dict) -> None:  # noqa: N805
                data = json.dumps(body).encode()
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            def do_GET(handler) -> None:  # noqa: N805
                handler._send({"data": [{"id": "m"}]} if handler.path == "/v1/models" else {})

            def do_POST(handler) -> None:  # noqa: N805
                body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
                if engine.hold.is_set():
                    engine.holding.set()
                    # readable with no bytes = the router closed the leg's connection
                    while not select.select([handler.connection], [], [], 30)[0]:
                        pass
                    if not handler.connection.recv(1):
                        engine.aborted.set()
                    handler.close_connection = True
                    return
                params = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
                if params:
                    handler._send({"kv_transfer_params": {"remote_engine_id": "p"}})
                else:
                    handler._send({"choices": [{"text": "done", "index": 0}]})

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


@pytest.fixture
def engine_and_router() -> Iterator[tuple[HoldingEngine, RouterServer]]:
    engine = HoldingEngine()
    pool = BackendPool.from_urls([engine.url], [engine.url])
    router = RouterServer(pool, settings=RouterSettings(probe_interval_s=0.5)).start()
    yield engine, router
    router.stop()
    engine.shutdown()


def metric(router: RouterServer, name: str, **labels: str) -> float:
    return sample_sum(httpx.get(f"{router.url}/metrics", timeout=10).text, name, **labels)


def test_a_client_leaving_while_its_prefill_runs_aborts_the_leg_and_the_router_serves_on(
    engine_and_router: tuple[HoldingEngine, RouterServer],
) -> None:
    engine, router = engine_and_router
    engine.hold.set()
    body = json.dumps(BODY).encode()
    with socket.create_connection((router.host, router.port), timeout=10) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert engine.holding.wait(15), "the prefill leg never reached the engine"
    assert engine.aborted.wait(15), "the leg's connection stayed open after the client left"
    engine.hold.clear()

    assert metric(router, "router_client_disconnects_total") == 1
    assert metric(router, "router_requests_total", outcome="client_disconnected") == 1
    assert metric(router, "router_in_flight_requests") == 0
    assert metric(router, "router_engine_in_flight_legs") == 0

    answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "done"
    assert metric(router, "router_requests_total", outcome="ok") == 1
