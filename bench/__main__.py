"""The benchmark suite: every figure a ratio against its anchor, measured side by side.

    python -m bench            registration, KV transfer, end to end (about 10 minutes here)
    python -m bench --smoke    small sizes, for CI: checks the results are well formed

Writes ``bench/results/<section>.json``, ``bench/results/latest.json`` (the headline ratios
with date, commit and machine) and, when matplotlib is installed, ``bench/results/latest.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import end_to_end, registration_cost, transfer

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    memory_kib = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    return {"cores": os.cpu_count(), "memory_gib": round(memory_kib / 2**20, 1)}


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def headline(registration: list[dict], moved: dict, e2e: dict) -> dict[str, Any]:
    by_layers = {row["layers"]: row for row in registration}
    register_row = by_layers.get(64) or registration[-1]
    large = [r["ratio"] for r in moved["blocks"] if r["block_bytes"] >= 256 << 10]
    single = next(
        r for r in e2e["rows"] if r["concurrency"] == min(x["concurrency"] for x in e2e["rows"])
    )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "register_ratio": register_row["ratio"],
        "register_layers": register_row["layers"],
        "transfer_vs_memcpy": statistics.median(large or [r["ratio"] for r in moved["blocks"]]),
        "router_overhead_ms_p50": single["router_overhead_ms_p50"],
        "pd_vs_colocated_ttft_ratio": single["pd_vs_colocated_ttft"],
    }


def plot(registration: list[dict], moved: dict, e2e: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["layers"] for r in registration], [r["ours_ms"] for r in registration], "o-",
                 label="ours")  # fmt: skip
    axes[0].plot([r["layers"] for r in registration], [r["stock_ms"] for r in registration], "s-",
                 label="stock")  # fmt: skip
    axes[0].set(xlabel="layers", ylabel="register_kv_caches (ms)", title="Registration")
    sizes = [r["block_bytes"] >> 10 for r in moved["blocks"]]
    axes[1].plot(sizes, [r["nixl_gbs"] for r in moved["blocks"]], "o-", label="NIXL READ")
    axes[1].plot(sizes, [r["memcpy_gbs"] for r in moved["blocks"]], "s-", label="memcpy")
    axes[1].set(xscale="log", xlabel="block (KiB)", ylabel="GB/s", title="KV transfer")
    conc = [r["concurrency"] for r in e2e["rows"]]
    for way in end_to_end.WAYS:
        axes[2].plot(conc, [r[way]["p50_s"] * 1e3 for r in e2e["rows"]], "o-", label=way)
    axes[2].set(xlabel="concurrent requests", ylabel="p50 latency (ms)", title="End to end")
    for axis in axes:
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    print("== registration cost", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        layers, repeats = ([8], 1) if args.smoke else ([8, 64, 256], 5)
        registration = [registration_cost.measure(n, repeats, Path(tmp)) for n in layers]
    print("== KV transfer", file=sys.stderr, flush=True)
    if args.smoke:
        moved = transfer.measure(4 << 20, 1, [64 << 10, 1 << 20], [1, 2])
    else:
        moved = transfer.measure(64 << 20, 5, transfer.BLOCK_SIZES, [1, 2, 4])
    print("== end to end", file=sys.stderr, flush=True)
    e2e = end_to_end.run(
        [1] if args.smoke else [1, 8, 32], 1 if args.smoke else 3, 8 if args.smoke else 16
    )
    suffix = "_smoke" if args.smoke else ""
    for name, data in (
        ("registration_cost", registration),
        ("transfer", moved),
        ("end_to_end", e2e),
    ):
        (RESULTS / f"{name}{suffix}.json").write_text(json.dumps(data, indent=2))
    top = headline(registration, moved, e2e)
    (RESULTS / f"latest{suffix}.json").write_text(json.dumps(top, indent=2))
    plotted = plot(registration, moved, e2e, RESULTS / f"latest{suffix}.png")
    print(json.dumps(top, indent=2))
    if not plotted:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
