"""``vllm-hybrid-nixl bench --smoke`` as users run it (a process, from the checkout): every
section runs for real — registration with real NIXL agents, a NIXL READ between two
processes, engines and the router on 127.0.0.1, then vllm-router in front of the same engines
with ``vllm bench serve`` against each target — and writes well-formed results. Timings are
not asserted (they belong to the full run, reported as ratios); shapes, signs and sanity are.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))


def finite_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [SCRIPT, "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "== end to end" in done.stderr  # progress is shown section by section
    assert "== our router against vllm-router" in done.stderr
    return out


def test_headline_numbers_with_date_commit_and_machine(results: Path) -> None:
    top = json.loads((results / "latest_smoke.json").read_text())
    for key in (
        "register_ratio",
        "register_ratio_mamba",
        "transfer_vs_memcpy",
        "transfer_vs_memcpy_one_core",
        "transfer_ours_vs_stock",
        "pd_vs_colocated_ttft_ratio",
        "pd_vs_colocated_itl_ratio",
        "pd_vs_colocated_tokens_per_s_ratio",
    ):
        assert finite_positive(top[key]), (key, top[key])
    assert math.isfinite(top["router_overhead_ms_p50"])  # may be negative: noise around 0
    assert top["machine"]["cores"] >= 1 and top["machine"]["memory_gib"] > 0
    assert len(top["commit"]) >= 7 and top["date"].startswith("20")
    # slopes from two prompt lengths: finite, of either sign on a noisy machine
    assert all(math.isfinite(v) for v in top["ttft_ms_per_1k_prompt_tokens"].values())
    assert set(top["ttft_ms_per_1k_prompt_tokens"]) == {"router", "colocated"}


def test_sections_are_complete(results: Path) -> None:
    registration = json.loads((results / "registration_cost_smoke.json").read_text())
    assert [(row["model"], row["layers"]) for row in registration] == [
        ("llama-hybrid", 8),
        ("nemotron-h", 8),  # the Mamba2 hybrid's row
    ]
    assert all(finite_positive(row[k]) for row in registration for k in ("ours_ms", "stock_ms"))
    moved = json.loads((results / "transfer_smoke.json").read_text())
    assert [row["block_bytes"] for row in moved["blocks"]] == [64 << 10, 1 << 20]
    assert all(
        finite_positive(row[k])
        for row in moved["blocks"]
        for k in ("nixl_gbs", "memcpy_gbs", "memcpy_one_core_gbs")
    )
    # the HMA forms: r descriptors per logical block, each measured with and without merging
    assert {(row["r"], row["nixl_merges_adjacent"]) for row in moved["forms"]} == {
        (1, True), (1, False), (2, True), (2, False),
    }  # fmt: skip
    e2e = json.loads((results / "end_to_end_smoke.json").read_text())
    [row] = e2e["rows"]
    for way in ("router", "client_legs", "colocated"):
        assert finite_positive(row[way]["ttft_p50_s"]) and finite_positive(row[way]["p50_s"])
        assert row[way]["ttft_p50_s"] <= row[way]["p50_s"]
        # the decode engine's own inter-token time: never the 0.00 of a client reading late
        assert finite_positive(row[way]["itl_p50_ms"]), (way, row[way])
        assert row[way]["itl_p50_ms"] <= row[way]["itl_p99_ms"]
    tokens = [r["prompt_tokens"] for r in e2e["prompt_scaling"]["rows"]]
    assert len(tokens) == 2 and tokens[0] < tokens[1]
    # each P/D request's KV as the decode engine counted it: more for the longer prompt
    moved = [r["pd_kv_bytes"] for r in e2e["prompt_scaling"]["rows"]]
    assert 0 < moved[0] < moved[1], moved
    assert all(r["pd_nixl_xfer_ms"] > 0 for r in e2e["prompt_scaling"]["rows"])
    assert finite_positive(e2e["prompt_scaling"]["kv_bytes_per_1k_tokens"])
    # the engines' own view of each P/D request: the prefill's TTFT, the decode's wait and TTFT
    for r in e2e["prompt_scaling"]["rows"]:
        assert finite_positive(r["pd_prefill_ttft_ms"]) and finite_positive(r["pd_decode_ttft_ms"])
        assert 0 <= r["pd_decode_queue_ms"] <= r["pd_decode_ttft_ms"]


def test_report_table_and_plot(results: Path) -> None:
    report = (results / "latest_smoke.md").read_text()
    assert "| registration: model | layers |" in report and "| end to end: concurrent |" in report
    png = (results / "latest_smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_router_comparison_ran_every_target_on_the_same_engines(results: Path) -> None:
    result = json.loads((results / "router_peer_smoke.json").read_text())
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
    assert "| router comparison: concurrent |" in (results / "latest_smoke.md").read_text()
    png = (results / "router_peer_smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
