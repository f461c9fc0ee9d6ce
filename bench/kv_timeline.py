"""Where a P/D request's wait for its KV goes on the decode engine, stage by stage, from the
engine's own timeline (``VLLM_HYBRID_NIXL_KV_TIMELINE``, :mod:`vllm_hybrid_nixl.connector.
kv_timeline`).

    python -m bench.kv_timeline FILE             # read a timeline a decode engine wrote
    python -m bench.kv_timeline --run [--concurrency 32] [--set direct_pins=false]

``--run`` starts a tiny stack (a prefill and a decode engine, a core each, our router; prefix
caching off) with the decode engine writing a timeline, sends ``vllm bench serve`` (random
256 in / 32 out, ``--ignore-eos``) through the router, and writes ``kv_timeline.json`` under
``bench/results/`` (``kv_timeline_KEY_VALUE.json`` with ``--set KEY=true|false``, a connector
key set on both engines).

Stages of one request, in milliseconds (each from the first event of its kind):

- ``to_first_schedule``: arrival to the first ``schedule()`` that asked for it;
- ``waiting_for_pin``: that first ``schedule()`` to the one that found its pin answered (0
  when the first did: the share of those is ``first_schedule_ready``);
- ``to_read_posted``: that ``schedule()`` to a worker posting the NIXL read;
- ``read``: the read posted to NIXL reporting it complete (seen when the worker looks, at the
  end of its step);
- ``digest_check``: NIXL's completion to the worker reporting the read (the KV digest);
- ``report_to_scheduler``: the worker's report to the scheduler seeing it;
- ``to_compute``: the scheduler seeing it to the step that computes the request;
- ``total``: arrival to that step.

Only requests with every stage and a read that was used count; ``--run`` includes
``vllm bench serve``'s warm-up requests (one per concurrent slot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.end_to_end import RESULTS

STAGES = (
    ("to_first_schedule", "arrive", "first_schedule"),
    ("waiting_for_pin", "first_schedule", "ready"),
    ("to_read_posted", "ready", "read_posted"),
    ("read", "read_posted", "read_done"),
    ("digest_check", "read_done", "read_reported"),
    ("report_to_scheduler", "read_reported", "recv_seen"),
    ("to_compute", "recv_seen", "scheduled"),
    ("total", "arrive", "scheduled"),
)


def requests_in(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Per request id: the time of the first event of each kind, ``first_schedule`` and
    ``ready`` (the first ``schedule`` event, the first with ``ready`` true), ``first_ready``
    (whether those are one) and ``failed`` (a read that failed or was refused). Lines that
    are not events are skipped."""
    found: dict[str, dict[str, Any]] = {}
    for line in lines:
        try:
            event = json.loads(line)
            name, req, when = str(event["event"]), str(event["req"]), float(event["t"])
        except (ValueError, KeyError, TypeError):
            continue
        times = found.setdefault(req, {})
        if event.get("failed"):
            times["failed"] = True
        if name == "schedule":
            if "first_schedule" not in times:
                times["first_schedule"] = when
                times["first_ready"] = bool(event.get("ready"))
            if event.get("ready"):
                times.setdefault("ready", when)
        else:
            times.setdefault(name, when)
    return found


def complete_requests(requests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests that went through every stage with a read that was used."""
    wanted = {event for _, start, end in STAGES for event in (start, end)}
    return [t for t in requests.values() if wanted <= t.keys() and not t.get("failed")]


def stage_times(requests: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Milliseconds of each stage, over :func:`complete_requests`."""
    complete = complete_requests(requests)
    return {
        stage: [(times[end] - times[start]) * 1e3 for times in complete]
        for stage, start, end in STAGES
    }


def summarize(requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stages = stage_times(requests)
    complete = len(stages["total"])
    summary: dict[str, Any] = {"requests": len(requests), "complete": complete}
    if not complete:
        return summary
    ready = [t["first_ready"] for t in complete_requests(requests)]
    summary["first_schedule_ready"] = sum(ready) / len(ready)  # over the stage table's requests
    summary["stages_ms"] = {
        stage: {
            "p50": statistics.median(values),
            "p90": (
                statistics.quantiles(values, n=10, method="inclusive")[-1]
                if len(values) > 1
                else values[0]
            ),
            "mean": statistics.mean(values),
        }
        for stage, values in stages.items()
    }
    return summary


def table(summary: dict[str, Any]) -> str:
    rows = [
        f"requests {summary['requests']}, complete {summary['complete']}, first schedule() "
        f"found the pin answered: {summary.get('first_schedule_ready', float('nan')):.0%}",
        f"{'stage':>20} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}",
    ]
    for stage, values in summary.get("stages_ms", {}).items():
        rows.append(f"{stage:>20} {values['p50']:8.2f} {values['p90']:8.2f} {values['mean']:8.2f}")
    return "\n".join(rows)


def run(concurrency: int, settings: dict[str, bool]) -> dict[str, Any]:
    """A tiny stack whose decode engine writes a timeline; one ``vllm bench serve`` run
    through the router; the timeline's summary."""
    from bench.end_to_end import tiny_stack
    from bench.pd_throughput import ENGINE_ARGS
    from bench.router_peer import bench_serve, prompts_for, warm_up
    from vllm_hybrid_nixl.connector.kv_timeline import ENV

    with tempfile.TemporaryDirectory() as tmp:
        timeline = Path(tmp) / "timeline.jsonl"
        os.environ[ENV] = str(timeline)  # the engines inherit it; the prefill writes nothing
        try:
            with tiny_stack(kv_extra_config=settings, engine_args=ENGINE_ARGS) as stack:
                warm_up(stack.urls["router"], stack.model)
                timeline.unlink(missing_ok=True)
                result = bench_serve(
                    stack.urls["router"],
                    stack.model,
                    concurrency,
                    prompts_for(concurrency, 6),
                    stack.work,
                    seed=concurrency,
                )
        finally:
            os.environ.pop(ENV, None)
        summary = summarize(requests_in(timeline.read_text().splitlines()))
    summary["output_tokens_per_s"] = result["output_throughput"]
    summary["ttft_p50_ms"] = result["median_ttft_ms"]
    return summary


def parse_settings(pairs: list[str]) -> dict[str, bool]:
    settings = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if value not in ("true", "false"):
            raise SystemExit(f"--set {pair}: expected KEY=true or KEY=false")
        settings[key] = value == "true"
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path, help="a timeline to read")
    parser.add_argument("--run", action="store_true", help="run a stack and write one")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(RESULTS), help="where --run writes its result")
    args = parser.parse_args()
    if args.file is None and not args.run:
        parser.error("give a timeline FILE or --run")
    if args.file is not None:
        print(table(summarize(requests_in(args.file.read_text().splitlines()))))
        return 0
    started = time.monotonic()
    settings = parse_settings(args.set)
    summary = run(args.concurrency, settings)
    summary.update(
        concurrency=args.concurrency,
        settings=settings,
        lengths={"input": 256, "output": 32},
        wall_s=time.monotonic() - started,
    )
    print(table(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "".join(f"_{key}_{str(value).lower()}" for key, value in settings.items())
    (out / f"kv_timeline{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
