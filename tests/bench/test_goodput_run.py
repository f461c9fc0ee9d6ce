"""``python -m bench.goodput --smoke --ways pd colocated_x2`` as a user runs it: four real
engines (a P/D pair, two colocated engines), two router processes, open-loop arrivals of both
workloads (the third way, one engine on both cores, is the same ``vllm serve`` without a
router; left out here for CI's time). Asserts every request of every way finished, the
engines' own inter-token histograms were read, KV moved over NIXL only for P/D, and the
results are complete; latencies and SLO shares are not asserted (the full run's report)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_every_way_answers_every_request_and_the_report_is_complete(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.goodput", "--smoke", "--ways", "pd", "colocated_x2",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "decode_heavy at 2.0/s" in done.stderr  # progress, run by run
    assert not (tmp_path / "latest.json").exists()  # a smoke run leaves the results alone
    result = json.loads((tmp_path / "goodput_smoke.json").read_text())
    assert result["model"]["shape"]["flops_per_kv_byte"] > 10_000
    assert set(result["workloads"]) == {"prefill_heavy", "decode_heavy"}
    for workload in result["workloads"].values():
        (row,) = workload["by_rate"].values()
        assert set(row) == {"pd", "colocated_x2"}
        for way, run in row.items():
            assert run["requests"] == run["finished"] == 3, (way, run)
            assert len(run["ttft_s"]) == 3 and all(t > 0 for t in run["ttft_s"])
            assert run["engine_itl_count"] > 0 and run["engine_itl_p99_ms"] > 0, (way, run)
            assert 0.0 <= run["slo_attainment"] <= 1.0
        stages = {way: run["engine_stage_means_ms"] for way, run in row.items()}
        assert "nixl_read" in stages["pd"]["decode"]  # P/D read its KV over NIXL
        assert "nixl_read" not in stages["colocated_x2"]["engine_a"]
        assert set(stages["colocated_x2"]) == {"engine_a", "engine_b"}
        for way, run in row.items():  # one rate: goodput is it exactly when 90% met the SLO
            assert workload["goodput_rps"][way] == (2.0 if run["slo_attainment"] >= 0.9 else 0)
        (stream,) = workload["arrival_streams"].values()
        assert len(stream["arrivals_s"]) == 3 and stream["realized_rate"] > 0
    top = result["headline"]
    assert set(top) >= {
        "goodput_prefill_heavy_pd_rps",
        "goodput_decode_heavy_crossover_rps_vs_colocated_x2",
    }
    assert all(v is None or math.isfinite(v) for v in top.values())
