"""``python -m bench.router_overhead`` as a user runs it, at a small size: our router and
vllm-router, each in its own process, relay every streamed request from the two model-free
upstream servers, and the results file carries a CPU cost for each router. Costs are not
compared (that is the full run's report, as a ratio); completeness and shape are."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 24


def test_both_routers_relay_every_request_and_their_cpu_is_reported(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.router_overhead", "--concurrency", "4",
         "--requests", str(REQUESTS), "--rounds", "1", "--tokens", "8", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "round 1, c=4, ours" in done.stderr  # progress, run by run
    result = json.loads((tmp_path / "router_overhead.json").read_text())
    runs = result["runs"]
    assert sorted(r["target"] for r in runs) == ["ours", "vllm_router"]
    for run in runs:
        assert run["ok"] == REQUESTS and run["failed"] == 0, run
        cost = run["router_cpu_ms_per_request"]
        assert math.isfinite(cost) and cost >= 0, run
    row = result["by_concurrency"]["4"]
    assert set(row) == {"ours", "vllm_router", "cpu_ours_vs_vllm_router"}
    assert all(value >= 0 for value in result["idle_cpu_ms_per_s"].values())
