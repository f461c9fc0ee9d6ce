"""2 prefill + 2 decode engines as Ray actors on a multi-node Ray cluster (three raylets on
this machine), the router in front: placement, correctness, 64 concurrent requests, and
engines killed by PID while traffic flows (the actors restart them).

The prefill engines are placed on one node and the decode engines on another by custom
resources; each raylet has its own loopback alias (head 127.0.0.2, prefill node
127.0.0.5, decode node 127.0.0.6), and every address an engine advertises is the IP its
node registered with Ray, never ``localhost`` or 127.0.0.1. Four engines on two cores,
across two raylets that may both use cores 0-1: the prefill engines share one core and the
decode engines the other (``placement.core_shares``). A decode engine on its prefill
engine's core stalled transfers for seconds to minutes (what was once blamed on the
aliases). The deployment runs with keys: the router's for clients, the engines' for the
router.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from tests.e2e.pd_fixture import (
    colocated_texts,
    compute_paused,
    engine_posts,
    metric_sum,
    request_reruns,
)
from tests.e2e.rolling_load import CLIENTS, REQUEST_TIMEOUT_S, Load, alone
from vllm_hybrid_nixl.deploy.keepalive import ENGINE_KEEP_ALIVE_S, KEEP_ALIVE_VAR
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.metrics_text import sample_sum, sample_values
from vllm_hybrid_nixl.deploy.ray.config import make_config
from vllm_hybrid_nixl.deploy.ray.deployment import PDDeployment
from vllm_hybrid_nixl.router.settings import RouterKeys

pytestmark = pytest.mark.e2e

HEAD_IP, PREFILL_IP, DECODE_IP = "127.0.0.2", "127.0.0.5", "127.0.0.6"
KEYS = RouterKeys(api_key="sk-ray-router-5e1f", engine_api_key="sk-ray-engines-9b7c")
ROUTER = {"Authorization": f"Bearer {KEYS.api_key}"}
ENGINE = KEYS.engine_headers()
WORDS = "a sliding window layer and a full attention layer share one kv cache"
# Some shorter and some longer than the 64-token sliding window and 64-token blocks.
PROMPTS = [
    f"request {i}: " + " ".join([WORDS] * n) for i, n in enumerate([1, 2, 3, 5, 6, 8, 11, 14])
]


@pytest.fixture(scope="module")
def deployment(tiny_hybrid_model, tmp_path_factory) -> Iterator[PDDeployment]:
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"node_ip_address": HEAD_IP, "num_cpus": 0, "include_dashboard": False},
    )
    cluster.add_node(node_ip_address=PREFILL_IP, num_cpus=2, resources={"prefill_node": 2})
    cluster.add_node(node_ip_address=DECODE_IP, num_cpus=2, resources={"decode_node": 2})
    config = make_config(
        model=str(tiny_hybrid_model),
        num_prefill=2,
        num_decode=2,
        block_size=64,
        max_model_len=1024,
        enforce_eager=True,
        prefill_resources={"prefill_node": 1},
        decode_resources={"decode_node": 1},
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        address=cluster.address,
        router_port=0,
        log_dir=str(tmp_path_factory.mktemp("ray-pd-logs")),
        startup_timeout_s=900,
        engine_restart_backoff_s=1.0,
        # A short pool expiry (serve's default here is 30 s, see keepalive.py): the load
        # test checks that pooled engine connections go back to baseline afterwards.
        router={"probe_interval_s": 1.0, "keepalive_expiry_s": 1.0},
    )
    try:
        with PDDeployment(config, keys=KEYS) as running:
            yield running
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def parse_cpu_list(text: str) -> set[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def colocated_url(deployment: PDDeployment) -> str:
    """A prefill engine answers plain requests (no kv_transfer_params) colocated."""
    return deployment.urls("prefill")[0]


def test_engines_are_placed_on_their_nodes_and_advertise_node_ips(deployment: PDDeployment) -> None:
    nodes = {node["NodeID"]: node for node in ray.nodes()}
    placed = {}
    for engine in deployment.engines:
        node = nodes[engine.info["node_id"]]
        wanted = "prefill_node" if engine.role == "prefill" else "decode_node"
        assert wanted in node["Resources"], (engine.name, node["Resources"])
        placed.setdefault(engine.role, set()).add(engine.info["node_id"])
        ip = node["NodeManagerAddress"]
        assert ip == (PREFILL_IP if engine.role == "prefill" else DECODE_IP)
        assert engine.info["node_ip"] == ip
        assert engine.info["url"].startswith(f"http://{ip}:")
        assert engine.info["side_channel"].startswith(f"{ip}:")
    assert len(placed["prefill"]) == 1 and len(placed["decode"]) == 1
    assert placed["prefill"] != placed["decode"]  # the two roles run on different raylets
    channels = [e.info["side_channel"] for e in deployment.engines]
    assert len(set(channels)) == len(channels)
    cores: dict[str, set[int]] = {"prefill": set(), "decode": set()}
    for e in deployment.engines:  # idle connections outlast the router's pool (keepalive.py)
        environ = Path(f"/proc/{e.info['pid']}/environ").read_bytes().split(b"\0")
        assert f"{KEEP_ALIVE_VAR}={ENGINE_KEEP_ALIVE_S}".encode() in environ, e.name
        bind = [v for v in environ if v.startswith(b"VLLM_CPU_OMP_THREADS_BIND=")]
        assert bind, f"{e.name} was given no cores"
        share = parse_cpu_list(bind[0].split(b"=", 1)[1].decode())
        # the whole engine runs on its share, not only its compute threads
        engine_processes = [e.info["pid"]] + [
            child.pid for child in psutil.Process(e.info["pid"]).children(recursive=True)
        ]
        assert {pid: os.sched_getaffinity(pid) for pid in engine_processes} == dict.fromkeys(
            engine_processes, share
        ), e.name
        cores[e.role] |= share
    # the two raylets may both use every core; the roles still never share one
    assert cores["prefill"] and cores["decode"] and not cores["prefill"] & cores["decode"], cores


def test_router_health_lists_every_engine(deployment: PDDeployment) -> None:
    health = httpx.get(f"{deployment.router_url}/health", timeout=30).json()  # open probe
    assert health["status"] == "ok"
    assert sorted(e["name"] for e in health["engines"]) == [
        "decode-0",
        "decode-1",
        "prefill-0",
        "prefill-1",
    ]
    assert all(e["up"] for e in health["engines"])
    # every engine's layout fingerprint was read from its side channel, and they all pair
    assert all("block_size=64" in e["layout"] for e in health["engines"]), health
    assert health["pairing_problems"] == []


def test_greedy_output_through_router_equals_colocated_and_kv_came_over_nixl(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    decodes = deployment.urls("decode")
    prompt_tokens = 0
    with httpx.Client(timeout=300.0) as client:
        before = [read_kv_transfer_counters(url, client) for url in decodes]
        for prompt in PROMPTS:
            body = {
                "model": str(tiny_hybrid_model),
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            routed = client.post(
                f"{deployment.router_url}/v1/completions", json=body, headers=ROUTER
            )
            colocated = client.post(
                f"{colocated_url(deployment)}/v1/completions", json=body, headers=ENGINE
            )
            assert routed.status_code == 200, routed.text
            assert (
                routed.json()["choices"][0]["token_ids"]
                == (colocated.json()["choices"][0]["token_ids"])
            ), prompt
            prompt_tokens += routed.json()["usage"]["prompt_tokens"]
        moved = [
            read_kv_transfer_counters(url, client) - was
            for url, was in zip(decodes, before, strict=True)
        ]
        metrics = client.get(f"{deployment.router_url}/metrics").text
    # The decode engines computed at most each prompt's last token themselves.
    assert sum(m.external_prompt_tokens for m in moved) >= prompt_tokens - len(PROMPTS)
    assert all(m.nixl_bytes > 0 and m.failed_transfers == 0 for m in moved)  # both served
    for url in deployment.urls("prefill"):  # round-robin reached every prefill engine
        legs = sample_sum(metrics, "router_leg_requests_total", engine=url, outcome="ok")
        assert legs > 0, metrics


def stream_text(client: httpx.Client, url: str, path: str, body: dict) -> str:
    pieces = []
    with client.stream(
        "POST", f"{url}{path}", json={**body, "stream": True}, headers=ROUTER
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_completions_and_chat_streamed_and_not_equal_colocated(
    deployment: PDDeployment, tiny_hybrid_model, endpoint: str, stream: bool
) -> None:
    body: dict = {
        "model": str(tiny_hybrid_model),
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"{endpoint} {stream} {WORDS * 3}"}]
    else:
        path = "/v1/completions"
        body["prompt"] = f"{endpoint} {stream} {WORDS * 3}"
    with httpx.Client(timeout=300.0) as client:
        expected_response = client.post(
            f"{colocated_url(deployment)}{path}", json=body, headers=ENGINE
        ).json()
        choice = expected_response["choices"][0]
        expected = choice.get("text") or choice["message"]["content"]
        if stream:
            got = stream_text(client, deployment.router_url, path, body)
        else:
            routed = client.post(f"{deployment.router_url}{path}", json=body, headers=ROUTER).json()
            got = routed["choices"][0].get("text") or routed["choices"][0]["message"]["content"]
    assert got == expected
    assert got  # 12 tokens were generated


def test_a_failing_leg_is_reported_with_leg_and_engine(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    """A request only the engine can judge (the router does not check sampling values)."""
    body = {"model": str(tiny_hybrid_model), "prompt": "hello", "max_tokens": 2, "top_p": 7.0}
    response = httpx.post(
        f"{deployment.router_url}/v1/completions", json=body, timeout=60, headers=ROUTER
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # The engine's own message, type and param; the engine by name, never by address.
    assert error["leg"] == "prefill" and error["engine"].startswith("prefill-")
    assert "top_p" in error["message"] and error["request_id"]
    assert not any(url in response.text for url in deployment.urls("prefill"))


def test_engines_and_router_require_their_keys(deployment: PDDeployment, tiny_hybrid_model):
    body = {"model": str(tiny_hybrid_model), "prompt": "hello", "max_tokens": 1}
    for url in deployment.urls("prefill") + deployment.urls("decode"):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
    response = httpx.post(f"{deployment.router_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 401


def test_models_lists_the_served_model(deployment: PDDeployment, tiny_hybrid_model) -> None:
    models = httpx.get(f"{deployment.router_url}/v1/models", timeout=30, headers=ROUTER).json()
    assert [m["id"] for m in models["data"]] == [str(tiny_hybrid_model)]


# ---- load and faults (these run last: they kill engines) ------------------------------


def load_bodies(model: str) -> list[dict]:
    """64 requests: 16 prompts of different lengths x 4 variants (streamed or not, 8 or 14
    tokens)."""
    bodies = []
    for i in range(16):
        prompt = f"load {i}: " + " ".join([WORDS] * (1 + i % 9))
        for stream, max_tokens in ((False, 8), (True, 8), (False, 14), (True, 14)):
            bodies.append(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": stream,
                }
            )
    return bodies


async def send_async(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str]:
    """(status, text of the answer, or the error body); streams are read to the end."""
    if not body.get("stream"):
        response = await client.post(url, json=body, headers=ROUTER)
        if response.status_code != 200:
            return response.status_code, response.text
        return 200, response.json()["choices"][0]["text"]
    pieces = []
    async with client.stream("POST", url, json=body, headers=ROUTER) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return 502, json.dumps(event)
                pieces.append(event["choices"][0].get("text") or "")
    return 200, "".join(pieces)


def expected_texts(deployment: PDDeployment, bodies: list[dict]) -> dict[tuple, str]:
    return colocated_texts(colocated_url(deployment), bodies, ENGINE)


def decode_posts(deployment: PDDeployment) -> float:
    return sum(engine_posts(url) for url in deployment.urls("decode"))


def router_engine_connections(deployment: PDDeployment) -> int:
    ports = {
        int(url.rsplit(":", 1)[1]) for url in deployment.urls("prefill") + deployment.urls("decode")
    }
    return sum(
        1
        for c in psutil.Process(deployment.router.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    )


def loop_lag(deployment: PDDeployment) -> list[str]:
    """The router's event-loop lag histogram, to tell a starved router from a failing engine."""
    metrics = httpx.get(f"{deployment.router_url}/metrics", timeout=30).text
    return [line for line in metrics.splitlines() if line.startswith("router_event_loop_lag")]


def test_64_concurrent_requests_all_answered_correctly_once(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    import asyncio

    bodies = load_bodies(str(tiny_hybrid_model))
    expected = expected_texts(deployment, bodies)
    url = f"{deployment.router_url}/v1/completions"
    connections_before = router_engine_connections(deployment)  # health probes keep some
    router_rss_before = psutil.Process(deployment.router.pid).memory_info().rss
    posts_before = decode_posts(deployment)
    reruns_before = request_reruns(deployment.router_url)

    async def fire() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            return await asyncio.gather(*(send_async(client, url, b) for b in bodies))

    started = time.monotonic()
    results = asyncio.run(fire())
    elapsed = time.monotonic() - started
    wrong = [
        (b["prompt"][:12], b["stream"], status, text[:200])
        for b, (status, text) in zip(bodies, results, strict=True)
        if status != 200 or text != expected[(b["prompt"], b["max_tokens"])]
    ]
    assert wrong == [], (wrong, loop_lag(deployment))
    # Every client got exactly one answer (above); the decode engines saw each request once,
    # plus whole-request re-runs after a broken decode link (which may not have arrived).
    reruns = request_reruns(deployment.router_url) - reruns_before
    posts = decode_posts(deployment) - posts_before
    assert len(bodies) <= posts <= len(bodies) + reruns
    print(
        f"\nLOAD 2P2D: {len(bodies)} concurrent requests, all correct, {elapsed:.1f}s, "
        f"{reruns:.0f} whole-request re-runs; router loop lag: {loop_lag(deployment)}"
    )
    # Back to baseline: nothing in flight, pooled connections expire, memory settles.
    time.sleep(deployment.router_settings.keepalive_expiry_s + 2.0)
    httpx.get(f"{deployment.router_url}/v1/models", headers=ROUTER, timeout=30)
    metrics = httpx.get(f"{deployment.router_url}/metrics", timeout=30).text
    assert sample_sum(metrics, "router_in_flight_requests") == 0, metrics
    legs = sample_values(metrics, "router_engine_in_flight_legs")
    assert legs and all(count == 0 for count in legs), metrics
    assert router_engine_connections(deployment) <= connections_before + 1
    router_rss = psutil.Process(deployment.router.pid).memory_info().rss
    assert router_rss - router_rss_before < 64 * 2**20


def engine(deployment: PDDeployment, name: str):
    return next(e for e in deployment.engines if e.name == name)


def engine_pid(deployment: PDDeployment, name: str) -> int:
    """The PID of the engine's API server, the leader of its process group."""
    return ray.get(engine(deployment, name).actor.info.remote())["pid"]


def kill_engine(deployment: PDDeployment, name: str, pid: int | None = None) -> int:
    """SIGKILL the engine's whole process group (API server, engine core, worker)."""
    pid = engine_pid(deployment, name) if pid is None else pid
    os.killpg(pid, signal.SIGKILL)
    return pid


def wait_back_up(deployment: PDDeployment, name: str, old_pid: int, timeout_s=600) -> float:
    """Seconds until the router reports ``name`` up again under a new process."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        status = ray.get(engine(deployment, name).actor.status.remote())
        health = httpx.get(f"{deployment.router_url}/health", timeout=30).json()
        state = next(e for e in health["engines"] if e["name"] == name)
        if status["pid"] != old_pid and status["restarts"] >= 1 and state["up"]:
            return time.monotonic() - started
        time.sleep(1.0)
    pytest.fail(f"{name} was not back after {timeout_s}s: {status}, {state}")


@pytest.fixture(scope="module")
def killed_engines() -> list[tuple[str, int, float]]:
    """(name, pid, when) of each engine the fault tests killed; the last test waits for all of
    them to come back at once, instead of one restart after the other."""
    return []


def metric_value(deployment: PDDeployment, name: str, **labels: str) -> float:
    """The router's /metrics samples ``name`` with ``labels``, summed (0 when none yet)."""
    return metric_sum(deployment.router_url, name, **labels)


def test_a_stalled_prefill_engine_gets_fewer_new_legs(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    """The default policy (least legs in flight): prefill-0 is stopped (SIGSTOP of its process
    group) while two clients send requests one after the other. A leg stuck on it keeps its
    in-flight count up, so new legs go to prefill-1; strict rotation would have sent every
    other leg to the stopped engine and stalled both clients. The router's metrics show the
    decisions. Then it continues, the stuck leg completes, and every answer is right."""
    bodies = [b for b in load_bodies(str(tiny_hybrid_model)) if not b["stream"]][:8]
    bodies = [{**b, "max_tokens": 4} for b in bodies]
    expected = expected_texts(deployment, bodies)
    url = f"{deployment.router_url}/v1/completions"
    urls = {e.name: e.info["url"] for e in deployment.engines}
    stalled, other = urls["prefill-0"], urls["prefill-1"]
    chosen_by_load = {"role": "prefill", "reason": "least_in_flight", "engine": other}
    before = metric_value(deployment, "router_policy_choices_total", **chosen_by_load)
    answers: dict[int, tuple[int, str]] = {}

    def client(indexes: range) -> None:
        with httpx.Client(timeout=600.0, headers=ROUTER) as http:
            for i in indexes:
                response = http.post(url, json=bodies[i])
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
                answers[i] = (response.status_code, text or response.text)

    pid = engine_pid(deployment, "prefill-0")
    started = time.monotonic()
    os.killpg(pid, signal.SIGSTOP)
    try:
        halves = (range(4), range(4, 8))
        clients = [threading.Thread(target=client, args=(r,)) for r in halves]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(all(i in answers for i in r) for r in halves):
            time.sleep(0.2)  # until one client got all four answers past the stopped engine
        stuck = metric_value(deployment, "router_engine_in_flight_legs", engine=stalled)
        by_load = metric_value(deployment, "router_policy_choices_total", **chosen_by_load)
    finally:
        os.killpg(pid, signal.SIGCONT)
    served_past = time.monotonic() - started
    for thread in clients:
        thread.join(timeout=600)
    print(
        f"\nstalled prefill: {len(answers)} answers; four past the stopped engine in "
        f"{served_past:.1f}s, all in {time.monotonic() - started:.1f}s"
    )
    assert stuck <= 1, stuck  # legs the stopped engine held while four others were served
    assert by_load - before >= 1  # prefill-1 chosen over a candidate with more legs in flight
    assert len(answers) == 8
    for i, body in enumerate(bodies):
        assert answers[i] == (200, expected[(body["prompt"], body["max_tokens"])]), answers[i]
    deadline = time.monotonic() + 120  # back in rotation before the fault tests
    while time.monotonic() < deadline:
        health = httpx.get(f"{deployment.router_url}/health", timeout=30).json()
        if all(e["up"] for e in health["engines"]):
            break
        time.sleep(1)
    assert all(e["up"] for e in health["engines"]), health
    print(f"stalled prefill: back in rotation {time.monotonic() - started:.1f}s after the stop")


def test_killed_prefill_engine_loses_no_request(
    deployment: PDDeployment, tiny_hybrid_model, killed_engines: list
) -> None:
    import asyncio

    bodies = load_bodies(str(tiny_hybrid_model))[:32]
    expected = expected_texts(deployment, bodies)
    url = f"{deployment.router_url}/v1/completions"

    async def flow() -> tuple[list, int]:
        async with httpx.AsyncClient(timeout=600.0) as client:
            tasks = []
            for i, body in enumerate(bodies):
                tasks.append(asyncio.create_task(send_async(client, url, body)))
                if i == 8:
                    await asyncio.sleep(0.5)
                    pid = await asyncio.to_thread(kill_engine, deployment, "prefill-0")
                await asyncio.sleep(0.1)
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 600)
            return done, pid

    results, old_pid = asyncio.run(flow())
    killed_at = time.monotonic()
    lost = [r for r in results if isinstance(r, BaseException)]
    assert lost == []
    ok = clear = 0
    for body, (status, text) in zip(bodies, results, strict=True):
        if status == 200:
            assert text == expected[(body["prompt"], body["max_tokens"])], body["prompt"][:20]
            ok += 1
        else:  # a clear error: an OpenAI-style body naming what failed
            assert status in (502, 503, 504), (status, text)
            assert "leg" in text or "engine" in text, text
            clear += 1
    later = [send_async_sync(url, body) for body in bodies[:4]]
    assert [status for status, _ in later] == [200] * 4
    killed_engines.append(("prefill-0", old_pid, killed_at))
    print(
        f"\nFAULT prefill kill: sent {len(bodies)}, ok {ok}, clear errors {clear}, lost 0 "
        f"(its restart is checked by the last test)"
    )


def send_async_sync(url: str, body: dict) -> tuple[int, str]:
    import asyncio

    async def one() -> tuple[int, str]:
        async with httpx.AsyncClient(timeout=300.0) as client:
            return await send_async(client, url, body)

    return asyncio.run(one())


def leg_ok_count(deployment: PDDeployment, engine_url: str) -> float:
    """Legs the router counted as answered by the engine at ``engine_url``."""
    return metric_value(deployment, "router_leg_requests_total", engine=engine_url, outcome="ok")


def test_killed_decode_engine_mid_stream_ends_the_stream_with_an_error(
    deployment: PDDeployment, tiny_hybrid_model, killed_engines: list
) -> None:
    """The decode engine that took the leg is killed at the stream's first event. Which one
    took it is read while both decode engines' cores are paused (SIGSTOP by PID), so the leg
    cannot finish before the router's in-flight count is read, however fast the engines are;
    the chosen engine then continues and is killed (one signal, nothing between) as soon as
    the client sees the first event, with hundreds of tokens still to go."""
    max_tokens = 900  # the prompt is under 40 tokens; max_model_len is 1024
    body = {
        "model": str(tiny_hybrid_model),
        "prompt": "a long answer " + WORDS,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    pids = {
        e.name: engine_pid(deployment, e.name) for e in deployment.engines if e.role == "decode"
    }
    target: dict[str, str] = {}
    chosen = threading.Event()
    seen: dict[str, Any] = {"events": 0, "error": None, "killed": None, "status": None}

    def client() -> None:
        with httpx.Client(timeout=300.0, headers=ROUTER) as http:
            with http.stream("POST", f"{deployment.router_url}/v1/completions", json=body) as r:
                seen["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        seen["error"] = event["error"]
                        return
                    seen["events"] += 1
                    if seen["killed"] is None and chosen.wait(300) and "name" in target:
                        name = target["name"]
                        seen["killed"] = (name, kill_engine(deployment, name, pids[name]))

    started = time.monotonic()
    streaming = threading.Thread(target=client, name="stream-client", daemon=True)
    try:
        with compute_paused(*pids.values()):
            streaming.start()
            deadline = time.monotonic() + 120
            busy: list[str] = []
            while not busy and time.monotonic() < deadline:
                health = httpx.get(f"{deployment.router_url}/health", timeout=30).json()
                busy = [
                    e["name"]
                    for e in health["engines"]
                    if e["role"] == "decode" and e["in_flight"] > 0
                ]
                time.sleep(0.2)
            assert len(busy) == 1, f"no decode leg reached a paused decode engine: {health}"
            target["name"] = busy[0]
    finally:
        chosen.set()  # the client kills the chosen engine at its first event
    streaming.join(timeout=300)
    assert not streaming.is_alive(), "the stream neither ended nor failed within 300 s"
    assert seen["status"] == 200, seen
    assert seen["killed"], "the stream ended before a decode engine could be killed"
    error, events = seen["error"], seen["events"]
    assert error is not None, f"stream ended after {events} events without an error event"
    assert "while streaming" in error["message"] and "incomplete" in error["message"]
    assert events < max_tokens
    killed = seen["killed"]
    print(f"\nFAULT decode kill mid-stream: error event after {time.monotonic() - started:.1f}s")
    killed_engines.append((*killed, time.monotonic()))
    # The other decode engine keeps serving at once.
    short = {**body, "max_tokens": 4, "stream": False}
    url = f"{deployment.router_url}/v1/completions"
    statuses = [send_async_sync(url, short)[0] for _ in range(4)]
    assert statuses == [200] * 4


def test_killed_engines_restart_and_serve_again(
    deployment: PDDeployment, tiny_hybrid_model, killed_engines: list
) -> None:
    """Runs after the two kill tests: each killed engine is restarted by its actor under a new
    PID, the router takes it back, and it serves requests again."""
    assert [name.split("-")[0] for name, _, _ in killed_engines] == ["prefill", "decode"], (
        "run this module whole: the kill tests above record what they killed"
    )
    url = f"{deployment.router_url}/v1/completions"
    short = {
        "model": str(tiny_hybrid_model),
        "prompt": "back again " + WORDS,
        "max_tokens": 4,
        "temperature": 0.0,
    }
    for name, old_pid, killed_at in killed_engines:
        wait_back_up(deployment, name, old_pid)
        back_after = time.monotonic() - killed_at
        engine_url = engine(deployment, name).info["url"]
        before = leg_ok_count(deployment, engine_url)
        deadline = time.monotonic() + 120
        while leg_ok_count(deployment, engine_url) <= before and time.monotonic() < deadline:
            assert send_async_sync(url, short)[0] == 200
        assert leg_ok_count(deployment, engine_url) > before, f"{name} got no leg after restart"
        print(f"\nFAULT {name}: back in rotation and serving {back_after:.0f}s after the kill")


@pytest.mark.slow  # ~300 s / ~155 s on two cores: not in .ci/run (docs/testing.md)
def test_a_rolling_restart_under_load_loses_no_request(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    """What ``serve`` does on SIGHUP: every engine drains and restarts in turn (prefill engines
    first) while 8 clients keep requests running through the router; every answer equals
    one engine's alone (token ids), none fails or hangs, no lease ends in a re-run, each
    engine exits 0 on its SIGTERM, and the other engine of its role carries the traffic."""
    model = str(tiny_hybrid_model)
    expected = alone(colocated_url(deployment), model, ENGINE)
    load = Load(deployment.router_url, model, expected, ROUTER)
    clients = [threading.Thread(target=load.run, args=(i,)) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    try:
        load.wait_answers(CLIENTS)
        restarted = deployment.rolling_restart()
        load.wait_answers(CLIENTS)
    finally:
        load.stop.set()
        for client in clients:
            client.join(timeout=REQUEST_TIMEOUT_S + 30)
    print(f"\nROLLING {dict(load.outcomes)}; {[(r['name'], r['stopped_s']) for r in restarted]}")
    assert not load.problems, load.problems[:10]
    assert [r["exit_code"] for r in restarted] == [0] * len(deployment.engines), restarted
    assert [r["role"] for r in restarted] == ["prefill", "prefill", "decode", "decode"]
    metrics = httpx.get(f"{deployment.router_url}/metrics", timeout=10).text
    assert sample_sum(metrics, "router_lease_reruns_total") == 0
