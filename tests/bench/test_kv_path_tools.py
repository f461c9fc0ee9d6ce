"""The two KV-path benchmarks' arithmetic: ``bench.kv_timeline`` turning a decode engine's
timeline into stage times (skipping lines that are not events), and ``bench.connector_ab``
pooling on/off runs into means and one ratio per round. The timeline written by real
engines is read in ``tests/e2e/test_integrity.py``."""

from __future__ import annotations

import json

import pytest

from bench.connector_ab import summarize as summarize_ab
from bench.kv_timeline import requests_in, stage_times, summarize, table


def event(t: float, name: str, req: str, **fields: object) -> str:
    return json.dumps({"t": t, "pid": 1, "event": name, "req": req, **fields})


def timeline(req: str, start: float, first_ready: bool) -> list[str]:
    """One request's events, 1 ms apart; a pin that missed its first schedule waits 5 ms."""
    wait = 0.0 if first_ready else 0.005
    lines = [event(start, "arrive", req), event(start + 0.001, "pin_asked", req, direct=True)]
    lines.append(event(start + 0.002, "schedule", req, ready=first_ready))
    if not first_ready:
        lines.append(event(start + 0.002 + wait, "schedule", req, ready=True))
    t = start + 0.002 + wait
    for name in ("alloc", "read_posted", "read_done", "read_reported", "recv_seen", "scheduled"):
        t += 0.001
        lines.append(event(t, name, req))
    return lines


def test_stage_times_per_request_and_the_first_schedule_share() -> None:
    lines = timeline("a", 10.0, first_ready=True) + timeline("b", 20.0, first_ready=False)
    lines += ["not json", json.dumps({"event": "arrive"}), event(30.0, "arrive", "c")]
    # "d" waited for its pin and never read; "e" read, but its read failed (never used)
    lines += [event(40.0, "arrive", "d"), event(40.001, "schedule", "d", ready=False)]
    failed = [
        line.replace('"req": "e"}', '"req": "e", "failed": true}')
        for line in timeline("e", 50.0, True)
    ]
    requests = requests_in(lines + failed)
    stages = stage_times(requests)
    assert len(stages["total"]) == 2  # only "a" and "b" count
    assert sorted(stages["waiting_for_pin"]) == pytest.approx([0.0, 5.0])
    assert stages["read"] == pytest.approx([1.0, 1.0])
    assert sorted(stages["total"]) == pytest.approx([8.0, 13.0])
    summary = summarize(requests)
    assert summary["requests"] == 5 and summary["complete"] == 2
    assert summary["first_schedule_ready"] == pytest.approx(0.5)  # of "a" and "b" alone
    assert 8.0 <= summary["stages_ms"]["total"]["p90"] <= 13.0  # within what was seen
    assert "found the pin answered: 50%" in table(summary)


def test_a_timeline_with_no_complete_request_says_so() -> None:
    summary = summarize(requests_in([event(1.0, "arrive", "a")]))
    assert summary == {"requests": 1, "complete": 0}


def ab_row(round_index: int, value: bool, tokens_per_s: float) -> dict:
    return {
        "round": round_index,
        "value": value,
        "output_tokens_per_s": tokens_per_s,
        "ttft_p50_ms": 100.0,
        "itl_p50_ms": 10.0,
        "decode_stage_means_ms": {"queue": 30.0 if value else 40.0, "ttft": 60.0},
    }


def test_on_off_means_and_one_ratio_per_round() -> None:
    rows = [ab_row(0, True, 900), ab_row(0, True, 1100), ab_row(0, False, 1000)]
    rows += [ab_row(1, False, 1000), ab_row(1, True, 1500)]
    rows += [ab_row(2, True, 700)]  # a round cut short: no pair, no ratio
    summary = summarize_ab(rows)
    assert summary["on_vs_off_per_round"]["output_tokens_per_s"] == pytest.approx([1.0, 1.5])
    assert summary["by_value"]["true"]["output_tokens_per_s"] == pytest.approx(1050)  # every run
    assert summary["by_value"]["true"]["decode_queue_ms"] == pytest.approx(30.0)
    assert summary["by_value"]["false"]["decode_queue_ms"] == pytest.approx(40.0)


def test_the_recorder_writes_only_when_given_a_path_and_never_raises(tmp_path) -> None:
    from vllm_hybrid_nixl.connector import kv_timeline

    path = tmp_path / "timeline.jsonl"
    try:
        kv_timeline.set_path(None)
        kv_timeline.record("arrive", "a")
        assert not kv_timeline.enabled() and not path.exists()
        kv_timeline.set_path(str(path))
        kv_timeline.record("arrive", "a")
        kv_timeline.record_all("read_done", ["a", "b"], failed={"b"})
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(e["event"], e["req"], e.get("failed")) for e in events] == [
            ("arrive", "a", None),
            ("read_done", "a", None),
            ("read_done", "b", True),
        ]
        kv_timeline.set_path(str(tmp_path))  # a directory: the write fails, quietly
        kv_timeline.record("arrive", "c")
    finally:
        kv_timeline.set_path(None)
