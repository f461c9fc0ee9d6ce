"""``python -m bench.router_peer`` as a user runs it, at its smallest: real engines, our router
and vllm-router in front of them, ``vllm bench serve`` against each target. Asserts every
request of every run completed and the results are complete; timings are not compared (that
is the full run's report)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_every_target_answers_every_request_and_rounds_pool(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.router_peer", "--concurrency", "2", "--rounds", "1",
         "--prompts-per-slot", "1", "--no-warm-up-round", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "router_peer.json").read_text())
    prompts = result["prompts"]["2"]
    assert prompts == 16  # at least 16 per run, whatever the slots
    runs = result["runs"]
    assert sorted(r["target"] for r in runs) == ["decode_alone", "ours", "vllm_router"]
    assert len({r["seed"] for r in runs}) == len(runs)  # every run its own prompts
    for run in runs:
        assert run["completed"] == prompts, run
        assert len(run["ttfts_ms"]) == prompts and len(run["e2els_ms"]) == prompts
        assert all(0 < t <= e for t, e in zip(run["ttfts_ms"], run["e2els_ms"], strict=True))
        shares = run["prefix_cache_hit_share"]
        # the decode engine serves a prompt in every run (P/D or alone); the prefill engine
        # only through a router
        assert 0 <= shares["decode"] <= 1, run
        if run["target"] == "decode_alone":
            assert shares["prefill"] is None, run
        else:
            assert 0 <= shares["prefill"] <= 1, run
    row = result["by_concurrency"]["2"]
    for target in ("ours", "vllm_router"):
        assert row[target]["requests"] == prompts
        assert math.isfinite(row[target]["router_cpu_ms_per_request"])
    assert "router_cpu_ms_per_request" not in row["decode_alone"]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["router_peer_commit"] and latest["router_peer_date"]
