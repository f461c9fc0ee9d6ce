"""2 prefill + 1 decode engines as Ray actors on a multi-node Ray cluster (three raylets on
this machine), the router in front.

The prefill engines are placed on one node and the decode engine on another by custom
resources; every address the engines advertise is the IP their node registered with Ray
(127.0.0.2 here), never ``localhost`` or 127.0.0.1. All raylets share that one loopback IP
(each raylet on its own loopback alias made UCX transfers stall here, a property of UCX on
aliased loopback, not of the placement under test). Three engines on two cores: the prefill
engines share one core and the decode engine has the other (``placement.engine_cores``);
with the decode engine sharing a core with a prefill engine, transfers stalled for minutes.
The deployment runs with keys: the router's for clients, the engines' for the router.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from vllm_hybrid_nixl.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.ray.config import make_config
from vllm_hybrid_nixl.ray.deployment import PDDeployment
from vllm_hybrid_nixl.router.settings import RouterKeys

pytestmark = pytest.mark.e2e

NODE_IP = "127.0.0.2"
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
        head_node_args={"node_ip_address": NODE_IP, "num_cpus": 0, "include_dashboard": False},
    )
    cluster.add_node(node_ip_address=NODE_IP, num_cpus=2, resources={"prefill_node": 2})
    cluster.add_node(node_ip_address=NODE_IP, num_cpus=1, resources={"decode_node": 1})
    config = make_config(
        model=str(tiny_hybrid_model),
        num_prefill=2,
        num_decode=1,
        block_size=64,
        max_model_len=1024,
        enforce_eager=True,
        prefill_resources={"prefill_node": 1},
        decode_resources={"decode_node": 1},
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        address=cluster.address,
        router_port=0,
        log_dir=str(tmp_path_factory.mktemp("ray-pd-logs")),
        startup_timeout_s=600,
    )
    try:
        with PDDeployment(config, keys=KEYS) as running:
            yield running
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


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
        assert ip == NODE_IP and engine.info["node_ip"] == ip
        assert engine.info["url"].startswith(f"http://{ip}:")
        assert engine.info["side_channel"].startswith(f"{ip}:")
    assert len(placed["prefill"]) == 1 and len(placed["decode"]) == 1
    assert placed["prefill"] != placed["decode"]  # the two roles run on different raylets
    channels = [e.info["side_channel"] for e in deployment.engines]
    assert len(set(channels)) == len(channels)


def test_router_health_lists_every_engine(deployment: PDDeployment) -> None:
    health = httpx.get(f"{deployment.router_url}/health", timeout=30).json()  # open probe
    assert health["status"] == "ok"
    assert sorted(e["name"] for e in health["engines"]) == ["decode-0", "prefill-0", "prefill-1"]
    assert all(e["up"] for e in health["engines"])
    # every engine's layout fingerprint was read from its side channel, and they all pair
    assert all("block_size=64" in e["layout"] for e in health["engines"]), health
    assert health["pairing_problems"] == []


def test_greedy_output_through_router_equals_colocated_and_kv_came_over_nixl(
    deployment: PDDeployment, tiny_hybrid_model
) -> None:
    decode = deployment.urls("decode")[0]
    prompt_tokens = 0
    with httpx.Client(timeout=300.0) as client:
        before = read_kv_transfer_counters(decode, client)
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
        moved = read_kv_transfer_counters(decode, client) - before
        metrics = client.get(f"{deployment.router_url}/metrics").text
    # The decode engine computed at most each prompt's last token itself.
    assert moved.external_prompt_tokens >= prompt_tokens - len(PROMPTS)
    assert moved.nixl_bytes > 0 and moved.failed_transfers == 0
    for url in deployment.urls("prefill"):  # round-robin reached every prefill engine
        assert f'router_leg_requests_total{{engine="{url}",leg="prefill",outcome="ok"}}' in metrics


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
    assert error["leg"] == "prefill" and error["engine"] in deployment.urls("prefill")
    assert error["message"].startswith("prefill leg failed on engine prefill-")
    assert "top_p" in error["message"]


def test_engines_and_router_require_their_keys(deployment: PDDeployment, tiny_hybrid_model):
    body = {"model": str(tiny_hybrid_model), "prompt": "hello", "max_tokens": 1}
    for url in deployment.urls("prefill") + deployment.urls("decode"):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
    response = httpx.post(f"{deployment.router_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 401


def test_models_lists_the_served_model(deployment: PDDeployment, tiny_hybrid_model) -> None:
    models = httpx.get(f"{deployment.router_url}/v1/models", timeout=30, headers=ROUTER).json()
    assert [m["id"] for m in models["data"]] == [str(tiny_hybrid_model)]
