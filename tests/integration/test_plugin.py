"""Registration through vLLM's plugin machinery, in fresh interpreters (vLLM loads plugins
once per process) against the real ``KVConnectorFactory``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

PROBE = textwrap.dedent(
    """
    import json
    from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias
    install_cpu_version_alias()
    from vllm.plugins import load_general_plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.config import KVTransferConfig
    from vllm_hybrid_nixl.connector.plugin import register
    load_general_plugins()
    registered = sorted(n for n in KVConnectorFactory._registry if "Hybrid" in n)
    results = []
    for config in CONFIGS:
        try:
            cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**config))
            results.append({"class": f"{cls.__module__}.{cls.__qualname__}"})
        except Exception as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    try:  # vLLM may call the plugin again in the same process
        register(); register()
        again = sorted(n for n in KVConnectorFactory._registry if "Hybrid" in n)
    except Exception as exc:
        again = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps({"registered": registered, "results": results, "again": again}))
    """
)


def probe(configs: list[dict], plugins: str | None) -> dict:
    """Load vLLM's general plugins in a fresh interpreter and resolve each connector config."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    script = PROBE.replace("CONFIGS", repr(configs))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


BOTH = ["HybridNixlConnector", "HybridNixlPushConnector"]


def test_entry_point_is_declared() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {p.name: p.value for p in points}[
        "hybrid_nixl"
    ] == "vllm_hybrid_nixl.connector.plugin:register"


def test_names_resolve_through_the_plugin_and_register_is_idempotent() -> None:
    result = probe([{"kv_connector": name, "kv_role": "kv_producer"} for name in BOTH], None)
    assert result["registered"] == BOTH
    assert result["results"] == [
        {"class": f"vllm_hybrid_nixl.connector.connectors.{n}"} for n in BOTH
    ]
    assert result["again"] == BOTH


def test_plugin_filter_naming_us_keeps_it() -> None:
    result = probe(
        [{"kv_connector": "HybridNixlConnector", "kv_role": "kv_consumer"}], plugins="hybrid_nixl"
    )
    assert result["results"] == [
        {"class": "vllm_hybrid_nixl.connector.connectors.HybridNixlConnector"}
    ]


def test_plugin_filter_without_us_still_works_with_module_path() -> None:
    by_name = {"kv_connector": "HybridNixlConnector", "kv_role": "kv_consumer"}
    by_path = {**by_name, "kv_connector_module_path": "vllm_hybrid_nixl.connector.connectors"}
    result = probe([by_name, by_path], plugins="another_plugin")
    assert result["registered"] == []
    assert "Unsupported connector type: HybridNixlConnector" in result["results"][0]["error"]
    assert result["results"][1] == {
        "class": "vllm_hybrid_nixl.connector.connectors.HybridNixlConnector"
    }
