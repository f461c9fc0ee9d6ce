"""AMX tile permission after vLLM loads our plugin (``connector/cpu_amx.py``), in a fresh
interpreter. About the CPU and Linux, not the vLLM release, so outside the version matrix."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


AMX_PROBE = textwrap.dedent(
    """
    import json
    from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias
    install_cpu_version_alias()
    from vllm_hybrid_nixl.connector.cpu_amx import amx_permitted
    before = amx_permitted()
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    print("RESULT " + json.dumps({"before": before, "after": amx_permitted()}))
    """
)


def cpu_has_amx_tiles() -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    return "amx_tile" in flags


def test_plugin_load_grants_amx_tiles_where_the_cpu_has_them() -> None:
    """On an AMX CPU, a process that loaded vLLM's plugins may run tile instructions: vLLM's
    CPU attention uses them in a decode engine's first step and died with SIGILL without
    the permission. Elsewhere the plugin must not claim a permission the CPU cannot have."""
    done = subprocess.run(
        [sys.executable, "-c", AMX_PROBE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["before"] is False  # a fresh process starts without it
    assert result["after"] is cpu_has_amx_tiles()
