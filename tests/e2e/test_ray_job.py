"""The documented ``ray job submit`` flow: a Ray cluster with its job server (started by
the test, 127.0.0.2), the job entry point submitted through Ray's own JobSubmissionClient,
a request through the router it prints, then ``stop_job`` ends engines and router."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.test_cli_serve import alive, engine_pids
from vllm_hybrid_nixl.common.netutil import free_port

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


def test_job_entry_point_serves_and_stops_with_the_job(
    job_server: str, tiny_hybrid_model, tmp_path: Path
) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    logs = tmp_path / "logs"
    config = tmp_path / "pd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_hybrid_model),
                "num_prefill": 1,
                "num_decode": 1,
                "block_size": 64,
                "max_model_len": 512,
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
        body = {"model": str(tiny_hybrid_model), "prompt": "a ray job", "max_tokens": 4}
        response = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
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
