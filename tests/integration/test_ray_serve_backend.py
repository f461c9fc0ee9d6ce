"""Ray Serve LLM: our connector in Ray's real KV-connector backend registry.

What runs: Ray's own registry, factory, ``LLMConfig.setup_engine_backend`` (the step a
Serve replica runs before starting vLLM) and ``build_pd_openai_app`` on our shipped Serve
config; the registry read from another process of a real local Ray cluster. What does not:
Serve replicas serving a model (Ray Serve LLM 2.60 pins vllm 0.29 with CUDA; only its
import-time requirements are installed beside vLLM's CPU build here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

SERVE_CONFIG = Path(__file__).parents[2] / "configs" / "ray" / "serve_pd.yaml"
SIDE_CHANNEL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST")


def test_unknown_to_ray_without_us_and_nixl_backend_with_us() -> None:
    """In a fresh interpreter: Ray gives an unregistered name its do-nothing backend."""
    script = (
        "from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import "
        "KVConnectorBackendFactory as F\n"
        "print(F.get_backend_class('HybridNixlConnector').__name__)\n"
        "from vllm_hybrid_nixl.connector.ray_serve import register_ray_serve_backends\n"
        "print(register_ray_serve_backends(), register_ray_serve_backends())\n"
        "print(F.get_backend_class('HybridNixlConnector').__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == [
        "DefaultConnectorBackend",
        "True True",  # idempotent
        "NixlConnectorBackend",
    ]


def backend_setup(connector: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, dict]:
    from ray.serve.llm import LLMConfig

    for name in SIDE_CHANNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    config = LLMConfig(
        model_loading_config={"model_id": "m"},
        engine_kwargs={
            "kv_transfer_config": {"kv_connector": connector, "kv_role": "kv_both"},
            "data_parallel_rank": 3,
        },
        experimental_configs={"NIXL_SIDE_CHANNEL_PORT_BASE": 23000},
    )
    config.setup_engine_backend()
    kv = config.engine_kwargs["kv_transfer_config"]
    return os.environ[SIDE_CHANNEL_ENV[0]], os.environ[SIDE_CHANNEL_ENV[1]], kv


def test_ray_prepares_a_replica_of_ours_exactly_as_one_of_nixl(monkeypatch) -> None:
    from vllm_hybrid_nixl.connector.ray_serve import register_ray_serve_backends

    assert register_ray_serve_backends()
    stock_port, stock_host, stock_kv = backend_setup("NixlConnector", monkeypatch)
    port, host, kv = backend_setup("HybridNixlConnector", monkeypatch)
    assert (port, host) == (stock_port, stock_host) == ("23003", host)  # base + DP rank
    # engine_id: a random replica suffix, then the side channel, as for NixlConnector
    assert kv["engine_id"].endswith(f"-{host}-{port}")
    assert stock_kv["engine_id"].endswith(f"-{host}-{port}")
    assert kv["engine_id"] != stock_kv["engine_id"]
    assert kv["kv_connector"] == "HybridNixlConnector"


def test_registration_reaches_other_processes_of_the_cluster() -> None:
    """Registered in this driver, resolved in a Ray worker process (Ray's internal KV)."""
    script = """
import ray
from vllm_hybrid_nixl.connector.ray_serve import register_ray_serve_backends
ray.init(_node_ip_address="127.0.0.2", include_dashboard=False, num_cpus=1)
register_ray_serve_backends()

@ray.remote
def resolve(name):
    import os
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory as F)
    return os.getpid(), F.get_backend_class(name).__name__

pid, name = ray.get(resolve.remote("HybridNixlConnector"))
print(pid != __import__("os").getpid(), name)
ray.shutdown()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True NixlConnectorBackend"


def test_shipped_serve_config_builds_a_pd_app_with_our_connector() -> None:
    from ray.serve.deployment import Application

    from vllm_hybrid_nixl.deploy.ray.serve import build_pd_openai_app

    application = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]
    assert application["import_path"] == "vllm_hybrid_nixl.deploy.ray.serve:build_pd_openai_app"
    args = application["args"]
    for role in ("prefill_config", "decode_config"):
        kv = args[role]["engine_kwargs"]["kv_transfer_config"]
        assert kv["kv_connector"] == "HybridNixlConnector"
    assert (
        args["prefill_config"]["engine_kwargs"]["block_size"]
        == args["decode_config"]["engine_kwargs"]["block_size"]
    )
    app = build_pd_openai_app(args)  # Ray validates every LLMConfig and builds the graph
    assert isinstance(app, Application)
