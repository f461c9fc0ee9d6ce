"""The documented ``ray job submit`` flow: a Ray cluster with its job server (started by
the test, 127.0.0.2), the job entry point submitted through Ray's own JobSubmissionClient,
requests through the router it prints, then ``stop_job`` ends engines and router. The job
serves the Mamba2 hybrid (tiny NemotronH) 1P1D, with nothing Mamba-specific in its config:
the launcher sets what Mamba P/D needs; answers equal the prefill engine's own (up to the near
tie explained in ``mamba_answers``) and the state comes over NIXL."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.mamba_answers import assert_same_answer
from tests.e2e.mamba_answers import body as mamba_body
from tests.e2e.test_cli_serve import alive, engine_pids
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters

pytestmark = pytest.mark.e2e

NODE_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def job_server(tmp_path_factory) -> Iterator[str]:
    from ray.cluster_utils import Cluster

    port = free_port(NODE_IP)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_JOB_STOP_WAIT_TIME_S", "60")  # our shutdown outlasts Ray's 3 s default
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "node_ip_address": NODE_IP,
                "num_cpus": 2,
                "include_dashboard": True,
                "dashboard_host": NODE_IP,
                "dashboard_port": port,
            },
        )
    try:
        yield f"http://{NODE_IP}:{port}"
    finally:
        cluster.shutdown()


def wait_for_router(client, job_id: str, timeout_s: float = 900) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = client.get_job_logs(job_id)
        found = re.search(r"^router: (http://\S+)$", logs, re.M)
        if found:
            return found[1]
        status = client.get_job_status(job_id)
        assert not status.is_terminal(), f"job ended ({status}):\n{logs[-4000:]}"
        time.sleep(2)
    pytest.fail("no router line in the job's log:\n" + client.get_job_logs(job_id)[-4000:])


def assert_mamba_pd_through(router: str, model: str) -> None:
    health = httpx.get(f"{router}/health", timeout=30).json()
    engines = {e["role"]: e["url"] for e in health["engines"]}
    body = mamba_body(model, "a ray job serves a mamba hybrid " * 8)
    with httpx.Client(timeout=300) as client:
        before = read_kv_transfer_counters(engines["decode"], client)
        routed = client.post(f"{router}/v1/completions", json=body)
        assert routed.status_code == 200, routed.text
        moved = read_kv_transfer_counters(engines["decode"], client) - before
        alone = client.post(f"{engines['prefill']}/v1/completions", json=body).json()
    assert_same_answer(routed.json()["choices"][0], alone["choices"][0])
    assert moved.nixl_bytes > 0 and moved.failed_transfers == 0
    assert moved.external_prompt_tokens >= routed.json()["usage"]["prompt_tokens"] - 1


def test_job_entry_point_serves_and_stops_with_the_job(
    job_server: str, tiny_mamba_model, tmp_path: Path
) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    logs = tmp_path / "logs"
    config = tmp_path / "pd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_mamba_model),
                "num_prefill": 1,
                "num_decode": 1,
                "block_size": 64,
                "max_model_len": 1024,
                "enforce_eager": True,
                "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                "router_port": 0,
                "log_dir": str(logs),
            }
        )
    )
    client = JobSubmissionClient(job_server)
    job_id = client.submit_job(
        entrypoint=f"{sys.executable} -m vllm_hybrid_nixl.deploy.ray.job --config {config}"
    )
    try:
        router = wait_for_router(client, job_id)
        assert_mamba_pd_through(router, str(tiny_mamba_model))
        pids = engine_pids(logs)
        assert len(pids) >= 6  # 2 engines x (API server, engine core, worker)
        assert alive(pids) == pids
    finally:
        client.stop_job(job_id)
        deadline = time.monotonic() + 120
        while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
            time.sleep(1)
    assert client.get_job_status(job_id) == JobStatus.STOPPED
    job_log = client.get_job_logs(job_id)
    assert "received SIGTERM, shutting down" in job_log, job_log[-3000:]
    deadline = time.monotonic() + 60
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(1)
    assert alive(pids) == set()
