"""The router's own guards, on a real router (uvicorn on 127.0.0.1) whose engine URLs point
at a port nobody listens on: everything checked here must be answered without an engine.
The body deadline's helper, ``limits.within``, is checked on both of its ways at the end: a
late awaitable gives the builtin TimeoutError (the 408), a timely one its result, and a
cancel from outside (the server stopping) propagates as a cancel."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.metrics_text import sample_sum
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.limits import within, within_task, within_wait_for
from vllm_hybrid_nixl.router.server import RouterProcess, RouterServer
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings

pytestmark = pytest.mark.integration

KEY = "sk-router-test-0123456789"
SETTINGS = RouterSettings(
    max_body_bytes=2048, header_timeout_s=1.0, body_timeout_s=1.0, max_prompt_chars=500
)


def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"  # free: nothing listens there


@pytest.fixture(scope="module")
def open_router() -> Iterator[RouterServer]:
    router = RouterServer(BackendPool.from_urls([nowhere()], [nowhere()]), settings=SETTINGS)
    yield router.start()
    router.stop()


@pytest.fixture(scope="module")
def keyed_router() -> Iterator[RouterProcess]:
    """In a process of its own, as the Ray launcher runs it: the keys cross the spawn pipe."""
    router = RouterProcess(
        BackendPool.from_urls([nowhere()], [nowhere()]),
        settings=SETTINGS.model_copy(update={"protect_probes": True}),
        keys=RouterKeys(api_key=KEY),
    )
    yield router.start()
    router.stop()


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == response.status_code
    return body["error"]


def leg_count(router: RouterServer) -> float:
    text = httpx.get(f"{router.url}/metrics", headers=auth(KEY)).text
    return sample_sum(text, "router_leg_requests_total")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one request and read its whole answer (a Content-Length body)."""
    sock.sendall(request)
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(4096)
        assert chunk, f"the router closed the connection; got {received[:200]!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int({name.lower(): value for name, value in fields.items()}[b"content-length"])
    while len(body) < length:
        body += sock.recv(4096)
    return head


BAD_REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n[]"


def test_an_idle_kept_alive_connection_outlives_the_header_deadline(
    open_router: RouterServer,
) -> None:
    """Idleness between requests is bounded by the keep-alive (longer than clients keep
    theirs), not by the header deadline: the same connection serves a request sent after
    twice the deadline; the router never closes a connection a client is about to reuse."""
    with socket.create_connection((open_router.host, open_router.port), timeout=10) as sock:
        assert _exchange(sock, BAD_REQUEST).startswith(b"HTTP/1.1 400")
        time.sleep(2 * SETTINGS.header_timeout_s)
        assert _exchange(sock, BAD_REQUEST).startswith(b"HTTP/1.1 400")


def test_a_kept_alive_connection_dribbling_its_next_headers_is_closed(
    open_router: RouterServer,
) -> None:
    with socket.create_connection((open_router.host, open_router.port), timeout=10) as sock:
        assert _exchange(sock, BAD_REQUEST).startswith(b"HTTP/1.1 400")
        time.sleep(2 * SETTINGS.header_timeout_s)  # idle first: that is allowed
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        closed = False
        for _ in range(20):  # a header line every 0.5 s, never the blank line
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.5)
    assert closed, "the router kept a kept-alive connection dribbling headers open for 10 s"


def test_the_router_keeps_idle_client_connections_longer_than_clients_do() -> None:
    """httpx (the openai client's transport) lets an idle connection go after 5 s."""
    assert RouterSettings().client_keep_alive_s > httpx.Limits().keepalive_expiry


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "p", "max_tokens": 0}', 400, "max_tokens must be at least 1"),
        (b'{"prompt": "p", "n": 40}', 400, "max_n"),
        (b'{"prompt": "' + b"a" * 600 + b'"}', 413, "600 characters"),
        (b'{"prompt": "' + b"a" * 3000 + b'"}', 413, "at most 2048"),
    ],
)
def test_bad_requests_get_openai_errors_without_touching_an_engine(
    open_router: RouterServer, content: bytes, status: int, words: str
) -> None:
    before = leg_count(open_router)
    response = httpx.post(
        f"{open_router.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert leg_count(open_router) == before  # no leg was sent


def test_oversized_chunked_body_is_cut_off_at_the_limit(open_router: RouterServer) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the router must count
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    response = httpx.post(f"{open_router.url}/v1/completions", content=chunks())
    assert response.status_code == 413
    assert "exceeds 2048 bytes" in error_of(response)["message"]


def test_a_body_that_trickles_in_gets_408(open_router: RouterServer, caplog) -> None:
    """The client gets the 408; the operator's log says how much of the body came, from
    whom (a slow client or packets held up on the way look alike to the router)."""
    caplog.set_level(logging.WARNING, logger="vllm_hybrid_nixl.router")
    with socket.create_connection((open_router.host, open_router.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
        started = time.monotonic()
        reply = sock.recv(4096)
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"did not arrive within 1 s" in reply
    assert waited < 5
    assert "408: 9 of 100 body bytes from 127.0.0.1:" in caplog.text
    assert b"127.0.0.1" not in reply  # addresses go to the log, not to the client


def test_a_client_leaving_mid_body_is_counted_as_gone_and_the_router_serves_on(
    open_router: RouterServer, caplog
) -> None:
    """A client that closes its connection before its body has arrived is counted as a
    client disconnect (no engine leg, no error in the log); the next request is served."""
    caplog.set_level(logging.ERROR)
    uvicorn_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to root
    uvicorn_log.addHandler(caplog.handler)

    def disconnects() -> float:
        text = httpx.get(f"{open_router.url}/metrics").text
        return sample_sum(text, "router_client_disconnects_total")

    try:
        before = disconnects()
        with socket.create_connection((open_router.host, open_router.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt"'
            )
            time.sleep(0.05)  # the handler starts reading the body (1 s deadline)
        deadline = time.monotonic() + 5
        while disconnects() == before and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert disconnects() == before + 1
    assert "Exception in ASGI application" not in caplog.text
    after = httpx.post(f"{open_router.url}/v1/completions", content=b"not json")
    assert after.status_code == 400 and "not valid JSON" in error_of(after)["message"]


def test_headers_that_trickle_in_get_the_connection_closed(open_router: RouterServer) -> None:
    with socket.create_connection((open_router.host, open_router.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed_after = None
        for _ in range(8):  # one header line every 0.5 s, never the blank line
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - started
                    break
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - started
                break
            time.sleep(0.5)
    assert closed_after is not None, "the router kept a slow-loris connection open for 4 s"
    assert closed_after < 3.0


def test_a_kept_alive_connection_serves_several_requests(open_router: RouterServer) -> None:
    """The header deadline re-arms after each response without cutting healthy clients."""
    with httpx.Client(base_url=open_router.url) as client:
        for _ in range(3):
            assert client.post("/v1/completions", content=b"[]").status_code == 400
            time.sleep(0.4)


@pytest.mark.parametrize(
    ("headers", "words"),
    [({}, "missing API key"), (auth("wrong"), "invalid API key"), (auth(KEY + "x"), "invalid")],
)
def test_v1_routes_need_the_key(keyed_router: RouterServer, headers, words) -> None:
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ):
        response = httpx.request(method, f"{keyed_router.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, response.text)
        error = error_of(response)
        assert error["type"] == "authentication_error" and words in error["message"]
        assert KEY not in response.text


def test_right_key_reaches_the_handler(keyed_router: RouterServer) -> None:
    response = httpx.post(f"{keyed_router.url}/v1/completions", headers=auth(KEY), json=[])
    assert response.status_code == 400  # past the key check, stopped by validation
    assert error_of(response)["type"] == "invalid_request_error"


def test_probes_are_open_by_default_and_protected_on_request(
    open_router: RouterServer, keyed_router: RouterServer
) -> None:
    assert httpx.get(f"{open_router.url}/metrics").status_code == 200
    assert httpx.get(f"{open_router.url}/health").status_code == 503  # engines unreachable
    assert httpx.get(f"{keyed_router.url}/metrics").status_code == 401
    assert httpx.get(f"{keyed_router.url}/health").status_code == 401
    assert httpx.get(f"{keyed_router.url}/metrics", headers=auth(KEY)).status_code == 200


def test_keys_stay_out_of_reprs() -> None:
    keys = RouterKeys(api_key=KEY, engine_api_key="sk-engine-secret")
    assert KEY not in repr(keys) and "sk-engine-secret" not in repr(keys)


def test_router_process_runs_apart_and_stops_by_pid(keyed_router: RouterProcess) -> None:
    import os

    assert keyed_router.pid and keyed_router.pid != os.getpid()
    metrics = httpx.get(f"{keyed_router.url}/metrics", headers=auth(KEY)).text
    # its event loop is watched: lag samples accumulate while it idles
    assert sample_sum(metrics, "router_event_loop_lag_seconds_count") > 0
    spare = RouterProcess(BackendPool.from_urls([nowhere()], [nowhere()])).start()
    pid = spare.pid
    assert httpx.get(f"{spare.url}/health").status_code in (200, 503)
    spare.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{spare.url}/health")


def test_an_announced_oversized_body_gets_413_before_it_is_sent(open_router) -> None:
    """Headers only, ``Content-Length`` far over the limit, no body byte sent: the answer
    comes at once (the router never waits for, or reads, the body)."""
    with socket.create_connection(("127.0.0.1", open_router.port), timeout=10) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        answer = connection.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"at most 2048" in answer


@pytest.mark.parametrize(
    ("host", "refused"),
    [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True)],
)
def test_a_router_beyond_loopback_needs_a_client_key(host: str, refused: bool) -> None:
    from vllm_hybrid_nixl.router.settings import UnsafeBindError, refuse_open_router

    if refused:
        with pytest.raises(UnsafeBindError, match="VLLM_HYBRID_NIXL_API_KEY"):
            refuse_open_router(host, RouterSettings(), RouterKeys())
        refuse_open_router(host, RouterSettings(), RouterKeys(api_key=KEY))
        refuse_open_router(host, RouterSettings(allow_unauthenticated_remote=True), RouterKeys())
    else:
        refuse_open_router(host, RouterSettings(), RouterKeys())


def test_the_router_command_refuses_an_open_bind_before_serving() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HYBRID_NIXL_")}
    script = os.path.join(os.path.dirname(sys.executable), "vllm-hybrid-nixl")
    done = subprocess.run(
        [
            script,
            "router",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
            "--prefill",
            nowhere(),
            "--decode",
            nowhere(),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--allow-unauthenticated-remote" in done.stderr


def test_a_router_on_a_taken_port_fails_at_start_naming_the_address() -> None:
    """The router binds before it serves: a port someone else holds is an error naming the
    address, raised by ``start()`` (not a router thread that dies unseen)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        router = RouterServer(BackendPool.from_urls([nowhere()], [nowhere()]), port=port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            router.start()


WITHIN_WAYS = [within, within_wait_for]
if sys.version_info >= (3, 11):  # asyncio.timeout is 3.11's
    WITHIN_WAYS.append(within_task)


async def late_result(result: str = "late") -> str:
    await asyncio.sleep(3600)
    return result


async def soon() -> str:
    await asyncio.sleep(0)
    return "soon"


@pytest.mark.parametrize("way", WITHIN_WAYS, ids=lambda f: f.__name__)
def test_a_late_awaitable_times_out_with_the_builtin_timeout_error(way) -> None:
    with pytest.raises(TimeoutError):
        asyncio.run(way(late_result(), 0.05))


@pytest.mark.parametrize("way", WITHIN_WAYS, ids=lambda f: f.__name__)
def test_a_timely_awaitable_gives_its_result(way) -> None:
    assert asyncio.run(way(soon(), 5.0)) == "soon"


@pytest.mark.parametrize("way", WITHIN_WAYS, ids=lambda f: f.__name__)
def test_a_cancel_from_outside_propagates_as_a_cancel(way) -> None:
    async def cancel_it() -> None:
        task = asyncio.ensure_future(way(late_result(), 60.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
