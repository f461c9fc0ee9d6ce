"""The base install (`pip install vllm-hybrid-nixl`, no extra) requires no Ray, FastAPI or
uvicorn, and what it promises runs without Ray: the connector classes build with vLLM, the
plugin registers them, and `check` starts, in a process where Ray cannot be imported at all.
(FastAPI, uvicorn and prometheus_client are vLLM's own requirements, so only our code is held
to not importing them: tests/unit/test_package_layers.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

BLOCKED = ("ray",)

SCRIPT = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"blocked: {{name}} (not in a lean install)")
            return None

    sys.meta_path.insert(0, Blocked())
    from vllm_hybrid_nixl.connector import plugin
    plugin.register()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm_hybrid_nixl.connector import HybridNixlConnector
    from vllm_hybrid_nixl.preflight import check
    from vllm_hybrid_nixl import cli
    assert "HybridNixlConnector" in KVConnectorFactory._registry
    assert not any(m.split(".")[0] in {BLOCKED!r} for m in sys.modules), sorted(
        m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
    try:
        cli.main(["check", "--help"])
    except SystemExit as exit:
        print("check --help exit", exit.code, HybridNixlConnector.__name__)
    """
)


def test_connector_plugin_and_check_need_no_optional_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "check --help exit 0 HybridNixlConnector" in done.stdout, done.stdout[-2000:]


def test_the_base_install_requires_no_ray_or_web_server() -> None:
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    base = {
        Requirement(text).name.lower()
        for text in requires("vllm-hybrid-nixl") or []
        if Requirement(text).marker is None
    }
    assert base == {"packaging", "nixl"}
