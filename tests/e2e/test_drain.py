"""A rolling restart under load loses nothing: real engines, our router, 32 clients.

While 32 clients keep requests running through the router (streamed and not, greedy), the
prefill engine is stopped (SIGTERM: it drains, :mod:`vllm_hybrid_nixl.connector.drain`) and
started again on the same ports, then the decode engine. Every answer must equal the decode
engine's own answer alone (the same token ids), none may fail or hang; while one role
is away the router runs requests colocated on the other engine, and P/D resumes once the
engine is back (the decode engine reads KV over NIXL again). The drained prefill served the
reads its leases had promised: no request was re-run for a released lease.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.pd_fixture import PdPair, running_router, start_pair
from tests.e2e.rolling_load import (
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    Load,
    alone,
    wait_for_pd,
)
from vllm_hybrid_nixl.deploy.engines import EngineProcess
from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum
from vllm_hybrid_nixl.router.backends import BackendPool

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tiny_hybrid_model: Path, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(tiny_hybrid_model, tmp_path_factory.mktemp("drain-logs"), {}, {})


# More than the other rolling restarts (rolling_load.CLIENTS): at 8 clients an engine had no
# request in flight at its SIGTERM (both drains "waiting for 0"), so nothing was drained.
CLIENTS = 32


def engine_state(router_url: str, role: str) -> str:
    engines = httpx.get(f"{router_url}/health", timeout=10).json()["engines"]
    return next(e["state"] for e in engines if e["role"] == role)


def restart(old: EngineProcess, router_url: str, log: Path) -> tuple[EngineProcess, float, int]:
    """SIGTERM (drain) and wait for the exit, then start it again on the same ports; the
    new engine once the router has it back in rotation, the stop's seconds and exit code."""
    started = time.monotonic()
    old.stop(timeout_s=120)
    stopped_s = time.monotonic() - started
    assert old.process is not None
    new = EngineProcess(old.spec, log).start()
    new.wait_healthy(timeout_s=420)
    deadline = time.monotonic() + 60
    while engine_state(router_url, old.spec.role) != "up":
        assert time.monotonic() < deadline, f"the router did not take the {old.spec.role} back"
        time.sleep(0.5)
    return new, stopped_s, old.process.returncode


def colocated_runs(router_url: str, reason: str) -> float:
    text = read_metrics(router_url, None, timeout_s=10.0)
    return sample_sum(text, "router_policy_choices_total", role="colocated", reason=reason)


def test_restarting_each_engine_under_load_loses_no_request(pair: PdPair, tmp_path: Path) -> None:
    expected = alone(pair.decode.spec.url, pair.model)
    assert all(len(ids) == MAX_TOKENS for ids in expected.values()), expected
    pool = BackendPool.from_urls(
        [pair.prefill.spec.url],
        [pair.decode.spec.url],
        [pair.prefill.spec.side_channel],
        [pair.decode.spec.side_channel],
    )
    engines = [pair.prefill, pair.decode]
    with running_router(pool) as router_url:
        load = Load(router_url, pair.model, expected)
        clients = [threading.Thread(target=load.run, args=(i,)) for i in range(CLIENTS)]
        for client in clients:
            client.start()
        stops = {}
        try:
            load.wait_answers(CLIENTS)
            for index, role in enumerate(("prefill", "decode")):
                engines[index], stopped_s, code = restart(
                    engines[index], router_url, tmp_path / f"{role}-restarted.log"
                )
                stops[role] = (stopped_s, code)
                moved = wait_for_pd(load, engines[1].spec.url, CLIENTS)  # reads over NIXL
                assert moved > 0, f"no P/D after the {role} came back"
        finally:
            load.stop.set()
            for client in clients:
                client.join(timeout=REQUEST_TIMEOUT_S + 30)
            for engine in engines:
                if engine not in (pair.prefill, pair.decode):
                    engine.stop()
        print(f"outcomes {dict(load.outcomes)}, stops (s, exit code) {stops}")
        assert not load.problems, load.problems[:10]
        assert load.outcomes["ok"] >= 3 * CLIENTS
        assert colocated_runs(router_url, "no_prefill") > 0
        assert colocated_runs(router_url, "no_decode") > 0
        metrics = read_metrics(router_url, None, timeout_s=10.0)
        assert sample_sum(metrics, "router_lease_reruns_total") == 0
    for role, (_, code) in stops.items():
        assert code == 0, f"the {role} engine exited with {code} on SIGTERM"
    accepted = 0
    for log in (pair.prefill.log_text(), pair.decode.log_text()):
        assert "drained: every accepted request ended" in log
        accepted += int(re.search(r"waiting for (\d+) accepted request", log).group(1))
    assert accepted > 0, "no request was running when the engines were asked to stop"
