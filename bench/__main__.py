"""The benchmark suite: every figure a ratio against its anchor, measured side by side.

    python -m bench            registration, KV transfer (and per UCX transport, and between
                               registered workers: ours vs stock), end to end, our router
                               against vllm-router
    python -m bench --smoke    small sizes, for CI: checks the results are well formed (no
                               router comparison: its engines and three concurrencies
                               take minutes)
    vllm-hybrid-nixl bench     the same

Writes ``<section>.json``, ``latest.json`` (the headline ratios with date, commit and
machine), ``latest.md`` (the report as tables) and, when matplotlib is installed (the
``bench`` extra), ``latest.png`` under ``bench/results/`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import end_to_end, registration_cost, router_peer, transfer, worker_transfer

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


def attention_rows(registration: list[dict]) -> list[dict]:
    """The sliding-window + full-attention rows (the layer-count series)."""
    return [r for r in registration if r.get("model", "llama-hybrid") == "llama-hybrid"]


def headline(
    registration: list[dict],
    moved: dict,
    e2e: dict,
    workers: dict | None = None,
    peer: dict | None = None,
) -> dict[str, Any]:
    mamba = [r for r in registration if r not in attention_rows(registration)]
    registration = attention_rows(registration)
    by_layers = {row["layers"]: row for row in registration}
    register_row = by_layers.get(64) or registration[-1]
    large = [r["ratio"] for r in moved["blocks"] if r["block_bytes"] >= 256 << 10]
    single = next(
        r for r in e2e["rows"] if r["concurrency"] == min(x["concurrency"] for x in e2e["rows"])
    )
    top: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "register_ratio": register_row["ratio"],
        "register_layers": register_row["layers"],
        "transfer_vs_memcpy": statistics.median(large or [r["ratio"] for r in moved["blocks"]]),
        "transfer_vs_memcpy_one_core": statistics.median(
            [r["ratio_one_core"] for r in moved["blocks"] if r["block_bytes"] >= 256 << 10]
            or [r["ratio_one_core"] for r in moved["blocks"]]
        ),
        "router_overhead_ms_p50": single["router_overhead_ms_p50"],
        "pd_vs_colocated_ttft_ratio": single["pd_vs_colocated_ttft"],
        "pd_vs_colocated_itl_ratio": single["pd_vs_colocated_itl"],
        "pd_vs_colocated_tokens_per_s_ratio": single["pd_vs_colocated_tokens_per_s"],
    }
    if workers:
        top["transfer_ours_vs_stock"] = workers["ratio"]
    if peer:
        top.update(peer["headline"])
    if mamba:
        top["register_ratio_mamba"] = mamba[-1]["ratio"]
        top["register_layers_mamba"] = mamba[-1]["layers"]
    if len(registration) >= 2:
        layers = [r["layers"] for r in registration]
        top["register_ms_per_layer"] = {
            way: end_to_end.slope(layers, [r[f"{way}_ms"] for r in registration])
            for way in ("ours", "stock")
        }
    scaling = e2e.get("prompt_scaling", {})
    for way in ("router", "colocated"):
        if f"{way}_ttft_ms_per_1k_tokens" in scaling:
            top.setdefault("ttft_ms_per_1k_prompt_tokens", {})[way] = scaling[
                f"{way}_ttft_ms_per_1k_tokens"
            ]
    return top


def table(registration: list[dict], moved: dict, e2e: dict) -> str:
    """The report as Markdown (also printed)."""
    lines = [
        "| registration: model | layers | ours ms | stock ms | ours / stock |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.get('model', 'llama-hybrid')} | {r['layers']} | {r['ours_ms']:.1f} | "
        f"{r['stock_ms']:.1f} | {r['ratio']:.3f} |"
        for r in registration
    ]
    lines += [
        "",
        "| transfer: block | descriptors | NIXL GB/s | memcpy GB/s | NIXL / memcpy | "
        "memcpy one core GB/s | NIXL / one core |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['block_bytes'] >> 10} KiB | {r['descriptors']} | {r['nixl_gbs']:.2f} | "
        f"{r['memcpy_gbs']:.2f} | {r['ratio']:.2f} | {r['memcpy_one_core_gbs']:.2f} | "
        f"{r['ratio_one_core']:.2f} |"
        for r in moved["blocks"]
    ]
    if moved.get("ucx"):
        lines += ["", "| UCX_TLS | NIXL / memcpy (median) |", "|---|---|"]
        lines += [
            f"| `{r['ucx_tls']}` | "
            + (f"{r['median_ratio']:.2f} |" if "median_ratio" in r else f"fails: {r['error']} |")
            for r in moved["ucx"]
        ]
    lines += ["", "| HMA form: r | NIXL merges adjacent | µs per 256 KiB logical block |"]
    lines += ["|---|---|---|"]
    lines += [
        f"| {r['r']} | {r['nixl_merges_adjacent']} | {r['us_per_logical_block']:.1f} |"
        for r in moved["forms"]
    ]
    lines += [
        "",
        "| end to end: concurrent | router p50 ms | client legs p50 ms | colocated p50 ms | "
        "router added p50 ms | TTFT P/D / colocated | ITL P/D / colocated | tokens/s P/D / "
        "colocated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['concurrency']} | {r['router']['p50_s'] * 1e3:.0f} | "
        f"{r['client_legs']['p50_s'] * 1e3:.0f} | {r['colocated']['p50_s'] * 1e3:.0f} | "
        f"{r['router_overhead_ms_p50']:.1f} | {r['pd_vs_colocated_ttft']:.2f} | "
        f"{r['pd_vs_colocated_itl']:.2f} | {r['pd_vs_colocated_tokens_per_s']:.2f} |"
        for r in e2e["rows"]
    ]
    scaling = e2e.get("prompt_scaling", {}).get("rows", [])
    if scaling:
        lines += ["", "| prompt tokens | TTFT router ms | TTFT colocated ms |", "|---|---|---|"]
        lines += [
            f"| {r['prompt_tokens']} | {r['router_ttft_ms']:.0f} | {r['colocated_ttft_ms']:.0f} |"
            for r in scaling
        ]
    return "\n".join(lines) + "\n"


def worker_table(workers: dict) -> str:
    return (
        "\n| READ between registered workers | MiB | ours GB/s | stock GB/s | ours / stock |\n"
        "|---|---|---|---|---|\n"
        f"| every block, {workers['reads_per_pair']} reads per pair, alternating | "
        f"{workers['bytes'] >> 20} | {workers['ours_gbs']:.2f} | {workers['stock_gbs']:.2f} | "
        f"{workers['ratio']:.2f} |\n"
    )


def peer_table(peer: dict | None) -> str:
    if peer is None:
        return ""
    return "\n" + router_peer.table(peer)


def plot(registration: list[dict], moved: dict, e2e: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    registration = attention_rows(registration)
    layers = [r["layers"] for r in registration]
    for way, marker in (("ours", "o-"), ("stock", "s-")):
        axes[0].plot(layers, [r[f"{way}_ms"] for r in registration], marker, label=way)
    axes[0].set(xlabel="layers", ylabel="register_kv_caches (ms)", title="Registration")
    sizes = [r["block_bytes"] >> 10 for r in moved["blocks"]]
    axes[1].plot(sizes, [r["nixl_gbs"] for r in moved["blocks"]], "o-", label="NIXL READ")
    axes[1].plot(sizes, [r["memcpy_gbs"] for r in moved["blocks"]], "s-", label="memcpy")
    axes[1].set(xscale="log", xlabel="block (KiB)", ylabel="GB/s", title="KV transfer")
    conc = [r["concurrency"] for r in e2e["rows"]]
    for way in end_to_end.WAYS:
        axes[2].plot(conc, [r[way]["p50_s"] * 1e3 for r in e2e["rows"]], "o-", label=way)
    axes[2].set(xlabel="concurrent requests", ylabel="p50 latency (ms)", title="End to end")
    scaling = e2e.get("prompt_scaling", {}).get("rows", [])
    tokens = [r["prompt_tokens"] for r in scaling]
    for way in ("router", "colocated"):
        axes[3].plot(tokens, [r[f"{way}_ttft_ms"] for r in scaling], "o-", label=way)
    axes[3].set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="TTFT vs prompt length")
    for axis in axes:
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def in_child(function: Any, *args: Any) -> Any:
    """``function(*args)`` in a fresh process. NIXL agents keep their progress threads
    polling after their workers are gone (measured: a full core for the rest of the run after
    the registration section), so every section that makes agents in this process runs in a
    child that exits with them, and later sections get the machine's cores back."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=str(RESULTS), help="where results are written")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    suffix = "_smoke" if args.smoke else ""

    def save(name: str, data: Any) -> None:
        """Write a section's results as soon as it ends (a later failure loses only its own)."""
        (out / f"{name}{suffix}.json").write_text(json.dumps(data, indent=2))

    print("== registration cost", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        layers, repeats = ([8], 1) if args.smoke else ([8, 64, 256], 5)
        registration = [in_child(registration_cost.measure, n, repeats, Path(tmp)) for n in layers]
        mamba_layers = 8 if args.smoke else 64
        registration.append(
            in_child(
                registration_cost.measure,
                mamba_layers,
                repeats,
                Path(tmp),
                registration_cost.MAMBA_ARCH,
            )
        )
    save("registration_cost", registration)
    print("== KV transfer", file=sys.stderr, flush=True)
    if args.smoke:
        moved = in_child(transfer.measure, 4 << 20, 1, [64 << 10, 1 << 20], [1, 2])
    else:
        moved = in_child(transfer.measure, 64 << 20, 5, transfer.BLOCK_SIZES, [1, 2, 4])
        print("== UCX transports", file=sys.stderr, flush=True)
        moved["ucx"] = in_child(
            transfer.compare_ucx, 16 << 20, 3, [256 << 10, 1 << 20], transfer.UCX_CHOICES
        )
    save("transfer", moved)
    print("== KV transfer between registered workers (ours, stock)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        workers = in_child(
            worker_transfer.measure, 8 if args.smoke else 64, 1 if args.smoke else 5, Path(tmp)
        )
    save("worker_transfer", workers)
    print("== end to end", file=sys.stderr, flush=True)
    with end_to_end.tiny_stack() as stack:  # one stack (engines, our router) for both sections
        e2e = end_to_end.measure_stack(
            stack.urls,
            stack.model,
            [1] if args.smoke else [1, 8, 32],
            1 if args.smoke else 3,
            8 if args.smoke else 16,
            scaling_words=[4, 40] if args.smoke else [4, 24, 48, 72, 96],
        )
        e2e.update(engine_start_s=stack.start_s, kv_extra_config={})
        save("end_to_end", e2e)
        print("== our router against vllm-router", file=sys.stderr, flush=True)
        on_stack = (stack.urls, stack.router_pid, stack.model, stack.work)
        if args.smoke:  # that it runs: two at a time, one round, no untimed round
            peer = router_peer.run_on(*on_stack, [2], 1, 1, warm_up_round=False)
        else:
            peer = router_peer.run_on(*on_stack, [1, 8, 32], 4, 12)
        save("router_peer", peer)
    top = headline(registration, moved, e2e, workers, peer)
    top["wall_s"] = round(time.monotonic() - started)
    (out / f"latest{suffix}.json").write_text(json.dumps(top, indent=2))
    report = table(registration, moved, e2e) + worker_table(workers) + peer_table(peer)
    (out / f"latest{suffix}.md").write_text(report)
    plotted = plot(registration, moved, e2e, out / f"latest{suffix}.png")
    router_peer.plot(peer, out / f"router_peer{suffix}.png")
    print(report)
    print(json.dumps(top, indent=2))
    if not plotted:
        print("(matplotlib not installed: no plot; pip install -e .[bench])", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
