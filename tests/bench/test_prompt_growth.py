"""The arithmetic that sets the TTFT P/D adds per 1,000 prompt tokens against the transfer
those tokens need (bench/end_to_end.py); the measured inputs come from the smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.end_to_end import set_against_bandwidth, slope, slope_stderr, transfer_ms_at

pytestmark = pytest.mark.bench


def test_transfer_time_is_bytes_over_the_rate() -> None:
    assert transfer_ms_at(5.0, 5e6) == pytest.approx(1.0)  # 5 MB at 5 GB/s
    assert transfer_ms_at(2.0, 0.0) == 0.0


def test_the_added_ttft_is_set_against_the_median_rate_and_the_engines_reads(
    tmp_path: Path,
) -> None:
    rates = tmp_path / "transfer.json"
    rates.write_text(json.dumps({"blocks": [{"nixl_gbs": g} for g in (1.0, 4.0, 5.0)]}))
    scaling = {
        "kv_bytes_per_1k_tokens": 8e6,  # 8 MB: 2 ms at the median 4 GB/s
        "pd_added_ttft_ms_per_1k_tokens": 6.0,
        "nixl_xfer_ms_per_1k_tokens": 3.0,
    }
    judged = set_against_bandwidth(scaling, rates)
    assert judged["transfer_bench_nixl_gbs"] == 4.0
    assert judged["transfer_ms_per_1k_tokens_at_bench_rate"] == pytest.approx(2.0)
    assert judged["pd_added_vs_transfer_at_bench_rate"] == pytest.approx(3.0)
    assert judged["pd_added_vs_engine_xfer"] == pytest.approx(2.0)
    assert judged["pd_added_within_noise"] is False  # no standard error given
    scaling["nixl_xfer_ms_per_1k_tokens"] = 0.0  # reads too fast to grow: no ratio, not inf
    assert math.isnan(set_against_bandwidth(scaling, rates)["pd_added_vs_engine_xfer"])
    scaling["nixl_xfer_ms_per_1k_tokens"] = 3.0
    scaling["pd_added_ttft_ms_per_1k_tokens_stderr"] = 2.5  # 6 < 2 x 2.5 is false: a ratio
    assert set_against_bandwidth(scaling, rates)["pd_added_vs_transfer_at_bench_rate"] == 3.0
    scaling["pd_added_ttft_ms_per_1k_tokens_stderr"] = 3.5  # within two standard errors
    judged = set_against_bandwidth(scaling, rates)
    assert judged["pd_added_within_noise"] is True
    assert math.isnan(judged["pd_added_vs_transfer_at_bench_rate"])
    assert math.isnan(judged["pd_added_vs_engine_xfer"])


def test_without_two_prompt_sizes_or_a_transfer_run_nothing_is_claimed(tmp_path: Path) -> None:
    assert set_against_bandwidth({"rows": []}, tmp_path / "transfer.json") == {}
    assert set_against_bandwidth({"kv_bytes_per_1k_tokens": 1.0}, tmp_path / "missing.json") == {}


def test_a_slope_and_its_standard_error() -> None:
    xs = [0.1, 0.4, 0.8]
    assert slope(xs, [1.0 + 10 * x for x in xs]) == pytest.approx(10.0)
    assert slope_stderr(xs, [1.0 + 10 * x for x in xs]) == pytest.approx(0.0, abs=1e-9)
    # by hand: slope 0.5, residuals -0.5, 1, -0.5 -> sqrt(1.5 / (3 - 2) / 2)
    assert slope([0.0, 1.0, 2.0], [0.0, 2.0, 1.0]) == pytest.approx(0.5)
    assert slope_stderr([0.0, 1.0, 2.0], [0.0, 2.0, 1.0]) == pytest.approx(math.sqrt(0.75))
    assert math.isnan(slope_stderr([0.1, 0.2], [1.0, 2.0]))
