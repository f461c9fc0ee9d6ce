"""Ray Serve LLM P/D for real: the shipped ``configs/ray/serve_pd.yaml`` (its model and the
CPU-only settings filled in) through our ``build_pd_openai_app`` on a Ray cluster the test
starts on 127.0.0.4: Ray Serve's own ingress, prefill and decode servers, each replica a vLLM
engine (CPU build) with HybridNixlConnector. Greedy answers through Serve's OpenAI endpoint
equal one engine's alone, token for token, and the decode replica logged the prompt's KV
arriving over NIXL."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec

pytestmark = pytest.mark.e2e

NODE_IP = "127.0.0.4"
SERVE_CONFIG = Path(__file__).parents[2] / "configs" / "ray" / "serve_pd.yaml"
MODEL_ID = "tiny-hybrid"
WORDS = "a sliding window layer and a full attention layer share one kv cache"
PROMPTS = [f"serve {i}: " + " ".join([WORDS] * n) for i, n in enumerate([1, 4, 9])]
MAX_TOKENS = 12
ENGINE_ARGS = {"max_model_len": 1024, "enforce_eager": True}


def cpu_llm_config(shipped: dict, model: Path, core: int) -> dict:
    """The shipped LLMConfig with the model and what a CPU replica needs: one CPU bundle,
    vLLM's CPU platform and KV-cache size, the core its threads use, a host KV buffer."""
    config = copy.deepcopy(shipped)
    config["model_loading_config"] = {"model_id": MODEL_ID, "model_source": str(model)}
    config["placement_group_config"] = {"bundles": [{"CPU": 1}]}
    config["runtime_env"] = {
        "env_vars": {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": NODE_IP,
            "HF_HUB_OFFLINE": "1",
        }
    }
    config["engine_kwargs"].update(ENGINE_ARGS)
    config["engine_kwargs"]["kv_transfer_config"]["kv_buffer_device"] = "cpu"
    return config


@pytest.fixture(scope="module")
def serve_url(tiny_hybrid_model: Path) -> Iterator[str]:
    import ray
    from ray import serve

    from vllm_hybrid_nixl.deploy.ray.serve import build_pd_openai_app

    args = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]
    args["prefill_config"] = cpu_llm_config(args["prefill_config"], tiny_hybrid_model, 0)
    args["decode_config"] = cpu_llm_config(args["decode_config"], tiny_hybrid_model, 1)
    # Each server replica asks Ray for two logical CPUs (its actor and its engine's bundle)
    # and computes on the one core it is bound to; the ingress asks for none.
    args["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0}}
    port = free_port(NODE_IP)
    ray.init(_node_ip_address=NODE_IP, num_cpus=4, include_dashboard=False)
    try:
        serve.start(http_options={"host": NODE_IP, "port": port})
        serve.run(build_pd_openai_app(args), name="pd", route_prefix="/")
        yield f"http://{NODE_IP}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def completion(client: httpx.Client, url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    answer = client.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == 200, answer.text[:2000]
    return answer.json()["choices"][0]


def test_serve_pd_equals_one_engine_alone(
    serve_url: str, tiny_hybrid_model: Path, tmp_path: Path
) -> None:
    with httpx.Client(timeout=300.0) as client:
        pd = [completion(client, serve_url, MODEL_ID, p)["text"] for p in PROMPTS]
    from ray import serve

    serve.shutdown()  # frees both cores for the reference engine
    spec = EngineSpec(
        str(tiny_hybrid_model),
        free_port(),
        role="none",
        cpu_core=[0, 1],
        extra_args=["--enforce-eager", "--max-model-len", "1024", "--block-size", "64"],
    )
    engine = EngineProcess(spec, tmp_path / "colocated.log").start()
    try:
        engine.wait_healthy(timeout_s=420)
        with httpx.Client(timeout=300.0) as client:
            alone = [
                completion(client, spec.url, str(tiny_hybrid_model), p)["text"] for p in PROMPTS
            ]
    finally:
        engine.stop()
    assert pd == alone
    assert all(len(text) > 0 for text in pd)


def test_both_replicas_ran_our_worker_and_decode_read_over_nixl() -> None:
    """From Ray's session logs (every replica's output): our worker validated the caches of
    both engines, and the decode engine's NIXL worker planned a read from the prefill's."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    text = "\n".join(
        path.read_text(errors="replace")
        for path in logs.rglob("worker-*")
        if path.suffix in (".out", ".err")
    )
    validated = re.findall(r"vllm-hybrid-nixl: HybridNixlPullWorker \(pid \d+\) validated", text)
    assert len(validated) == 2, text[-3000:]
    assert "Transfer plan: TransferTopology(" in text, text[-3000:]
