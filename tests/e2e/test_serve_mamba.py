"""A Mamba2 hybrid (tiny NemotronH) as Ray actors: ``vllm-hybrid-nixl serve`` run as a user
runs it, 2 prefill + 1 decode engine behind the router on a local Ray cluster it starts.
Nothing Mamba-specific is passed: the launcher sets what Mamba P/D needs. Answers through
the router equal the prefill engines answering alone (up to the near tie explained in
``mamba_answers``), both prefill engines serve legs, the state comes over NIXL, and SIGTERM
stops everything. vllm-router, the other data plane, serves the same engines after our
pairing check. (1P1D as Ray actors: ``test_ray_job``, which serves the same model.)"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.mamba_answers import PROMPTS, assert_same_answer, body
from tests.e2e.pd_fixture import engine_posts
from tests.e2e.test_cli_serve import alive, engine_pids, kill_session, start, wait_session_empty
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters

pytestmark = pytest.mark.e2e


@dataclass
class Served:
    process: subprocess.Popen[str]
    router: str
    log_dir: Path
    model: str


@pytest.fixture(scope="module")
def served(tiny_mamba_model: Path, tmp_path_factory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("serve-mamba")
    config = work / "mamba-2p1d.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_mamba_model),
                "num_prefill": 2,
                "num_decode": 1,
                "engine_num_cpus": 0.5,  # three engines on a two-core machine
                "block_size": 64,
                "max_model_len": 1024,
                "enforce_eager": True,
                "router_port": 0,
            }
        )
    )
    proc = start(["serve", "--config", str(config), "--log-dir", str(work / "logs")], cwd=work)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("router: "):
                break
        assert lines and lines[-1].startswith("router: "), "".join(lines)[-4000:]
        yield Served(proc, lines[-1].split()[1], work / "logs", str(tiny_mamba_model))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        kill_session(proc.pid)


def engines(served: Served, role: str) -> list[str]:
    health = httpx.get(f"{served.router}/health", timeout=30).json()
    return [e["url"] for e in health["engines"] if e["role"] == role]


def test_two_prefill_and_one_decode_engine_are_up_and_pair(served: Served) -> None:
    health = httpx.get(f"{served.router}/health", timeout=30).json()
    assert health["status"] == "ok", health
    assert sorted(e["name"] for e in health["engines"]) == ["decode-0", "prefill-0", "prefill-1"]
    assert health["pairing_problems"] == []


def test_mamba_pd_as_ray_actors_equals_colocated_and_state_came_over_nixl(
    served: Served,
) -> None:
    prefills = engines(served, "prefill")
    [decode] = engines(served, "decode")
    posts_before = [engine_posts(url) for url in prefills]
    with httpx.Client(timeout=300) as client:
        before = read_kv_transfer_counters(decode, client)
        routed = []
        for prompt in PROMPTS:
            answer = client.post(f"{served.router}/v1/completions", json=body(served.model, prompt))
            assert answer.status_code == 200, answer.text
            routed.append(answer.json())
        moved = read_kv_transfer_counters(decode, client) - before
        posts_after = [engine_posts(url) for url in prefills]
        prompt_tokens = sum(answer["usage"]["prompt_tokens"] for answer in routed)
        for prompt, answer in zip(PROMPTS, routed, strict=True):
            alone = client.post(f"{prefills[0]}/v1/completions", json=body(served.model, prompt))
            assert_same_answer(answer["choices"][0], alone.json()["choices"][0])
    # Each prefill engine served legs; the decode engine computed at most each last token.
    assert all(a > b for a, b in zip(posts_after, posts_before, strict=True)), posts_after
    assert moved.nixl_bytes > 0 and moved.failed_transfers == 0
    assert moved.external_prompt_tokens >= prompt_tokens - len(PROMPTS)


def test_the_launcher_set_what_mamba_pd_needs_in_every_engine(served: Served) -> None:
    logs = sorted(served.log_dir.glob("*.log"))
    assert len(logs) == 3, logs
    for log in logs:
        api_server = int(log.read_text(errors="replace").split("(APIServer pid=")[1].split(")")[0])
        environ = Path(f"/proc/{api_server}/environ").read_bytes().split(b"\0")
        assert b"VLLM_SSM_CONV_STATE_LAYOUT=DS" in environ, log
        cmdline = Path(f"/proc/{api_server}/cmdline").read_bytes().split(b"\0")
        assert b"--no-enable-prefix-caching" in cmdline, log


def vllm_router_cli(served: Served, with_side_channels: bool) -> subprocess.Popen[str]:
    """``vllm-hybrid-nixl router --router-kind vllm-router`` over the deployment's engines."""
    health = httpx.get(f"{served.router}/health", timeout=30).json()
    args = ["router", "--router-kind", "vllm-router", "--port", str(free_port())]
    for engine in health["engines"]:
        args += [f"--{engine['role']}", engine["url"]]
        if with_side_channels:
            args += [f"--{engine['role']}-side-channel", engine["side_channel"]]
    return start(args, cwd=served.log_dir)


def test_vllm_router_serves_the_same_engines_after_our_pairing_check(served: Served) -> None:
    """vllm-router as the data plane: started only once our check read every engine's
    layout (refused, exit 2, when it cannot), then its answers equal the engines' own and
    SIGTERM stops it."""
    refused = vllm_router_cli(served, with_side_channels=False)
    try:
        output, _ = refused.communicate(timeout=120)
    finally:
        kill_session(refused.pid)
    assert refused.returncode == 2, output[-3000:]
    assert "refusing to start vllm-router" in output and "could not be read" in output, output
    proc = vllm_router_cli(served, with_side_channels=True)
    try:
        lines = [""]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            lines.append(proc.stdout.readline())
            if lines[-1].startswith("router: "):
                break
        assert lines[-1].startswith("router: ") and "vllm-router" in lines[-1], "".join(lines)
        url = lines[-1].split()[1]
        prefill = engines(served, "prefill")[0]
        with httpx.Client(timeout=300) as client:
            for prompt in PROMPTS[:2]:
                answer = client.post(f"{url}/v1/completions", json=body(served.model, prompt))
                assert answer.status_code == 200, answer.text
                alone = client.post(f"{prefill}/v1/completions", json=body(served.model, prompt))
                assert_same_answer(answer.json()["choices"][0], alone.json()["choices"][0])
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert wait_session_empty(proc.pid) == []
    finally:
        kill_session(proc.pid)


def test_sigterm_stops_every_engine(served: Served) -> None:
    pids = engine_pids(served.log_dir)
    assert len(pids) >= 9  # 3 engines x (API server, engine core, worker)
    served.process.send_signal(signal.SIGTERM)
    served.process.communicate(timeout=120)
    assert served.process.returncode == 0
    assert wait_session_empty(served.process.pid) == []
    assert alive(pids) == set()
