"""Our router against vllm-router (the Rust P/D router, PyPI ``vllm-router``) and the decode
engine alone, in front of the same two engines, measured by vLLM's own load generator.

One prefill and one decode ``vllm serve`` (tiny hybrid model, HybridNixlConnector, a core
each); our router as its own process (``vllm-hybrid-nixl router``) and ``vllm-router
--vllm-pd-disaggregation``, both pointing at them. ``vllm bench serve`` (random prompts,
``--ignore-eos``) runs against each target in turn, for each concurrency, round after round,
with the order of targets rotated every round, so machine noise hits all alike, after one
untimed round (the rotation starts every concurrency with our router, which would otherwise
meet the engines' first batches of that size alone). Every run
draws prompts of its own (``--seed``): with one seed for all, every run after the first found
its prompts in the engines' prefix caches (measured here at 32 concurrent: prefill cache hits
33k of 98k prompt tokens on the first run, 83k on each repeat), so whichever target ran first
in a round paid for the others. Each run records the share of prompt tokens each engine found
in its prefix cache (vLLM's own counters), which says how alike the runs' work was. Each router
process's CPU seconds (user + system, the kernel's per-process accounting over all its
threads) are read before and after each run: CPU seconds per request.

Figures per (target, concurrency) pool every round's requests: output tokens/s is all output
tokens over all run time, TTFT and end-to-end latency percentiles are over every request's own
value (``--save-detailed``), so a p99 rests on hundreds of requests rather than on the worst
two of one run. Headline (worse of concurrency 8 and 32): ``router_vs_vllm_router_
throughput`` (ours / peer, output tokens/s) and ``router_vs_vllm_router_p99_ttft``. Each run's
own figures stay in ``runs`` (the round-to-round spread).

    python -m bench.router_peer [--concurrency 1 8 32] [--rounds 3] [--prompts-per-slot 12]

Run alone, it also refreshes the two router keys of ``results/latest.json`` (the rest of that
file stays from the last full ``python -m bench``), with this run's date and commit beside
them as ``router_peer_date`` and ``router_peer_commit``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.end_to_end import RESULTS, percentile, tiny_stack, wait_for_health

TARGETS = ("ours", "vllm_router", "decode_alone")
HEADLINE_CONCURRENCY = (8, 32)
#: The per-round ratios of ours to vllm-router, in the table's column order.
RATIO_KEYS = ("throughput", "p99_ttft", "p50_ttft")


def start_vllm_router(prefill: str, decode: str, log: Path) -> tuple[subprocess.Popen, str]:
    from vllm_hybrid_nixl.common.netutil import free_port
    from vllm_hybrid_nixl.common.processes import die_with_parent

    port, metrics_port = free_port(), free_port()
    binary = str(Path(sys.executable).with_name("vllm-router"))
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                binary, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            ],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, [process])
    except RuntimeError:
        process.kill()
        raise RuntimeError(f"vllm-router did not come up; see {log}") from None
    return process, url


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_serve(
    url: str,
    model: str,
    concurrency: int,
    prompts: int,
    out: Path,
    seed: int = 0,
    lengths: tuple[int, int] = (256, 32),
) -> dict:
    """One ``vllm bench serve`` run with the prompts of ``seed``; its saved result. Each run
    first sends ``concurrency`` untimed requests at once through the same target (vLLM's
    ``--num-warmups``): a router whose idle connections expired between its runs opens them
    then, not in the timed burst, and every target gets the same warm-up."""
    name = f"run-{time.monotonic_ns()}.json"
    command = [
        sys.executable, "-m", "vllm_hybrid_nixl.connector.launcher", "bench", "serve",
        "--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(lengths[0]),
        "--random-output-len", str(lengths[1]),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--ignore-eos", "--save-result", "--result-dir", str(out),
        "--result-filename", name, "--percentile-metrics", "ttft,itl,e2el",
        "--metric-percentiles", "50,99", "--save-detailed", "--seed", str(seed),
        "--num-warmups", str(concurrency),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads((out / name).read_text())


def prefix_cache_counts(engine_url: str) -> tuple[float, float]:
    """An engine's prefix-cache hits and queries (prompt tokens) so far, from its /metrics."""
    from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum

    text = read_metrics(engine_url)
    return (
        sample_sum(text, "vllm:prefix_cache_hits_total"),
        sample_sum(text, "vllm:prefix_cache_queries_total"),
    )


def hit_shares(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Per engine, the share of a run's prompt tokens found in the prefix cache."""
    shares: dict[str, float | None] = {}
    for role, (hits, queries) in after.items():
        asked = queries - before[role][1]
        shares[role] = (hits - before[role][0]) / asked if asked > 0 else None
    return shares


def run_seed(round_index: int, concurrency: int, target_index: int) -> int:
    """A seed no other run of this benchmark uses: fresh prompts for every run."""
    return 1 + (round_index * 1000 + concurrency) * len(TARGETS) + target_index


def measure(
    urls: dict[str, str],
    engines: dict[str, str],
    pids: dict[str, int],
    model: str,
    concurrency: list[int],
    rounds: range,
    per_slot: int,
    out: Path,
    lengths: tuple[int, int] = (256, 32),
) -> list[dict[str, Any]]:
    """One run per target, concurrency and round of ``rounds`` (their indexes pick the
    prompts and the order of the targets)."""
    runs: list[dict[str, Any]] = []
    for round_index in rounds:
        for c in concurrency:
            order = [t for t in TARGETS if t in urls]
            shift = round_index % len(order)
            for target in order[shift:] + order[:shift]:
                seed = run_seed(round_index, c, TARGETS.index(target))
                cached = {role: prefix_cache_counts(url) for role, url in engines.items()}
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                prompts = prompts_for(c, per_slot)
                result = bench_serve(urls[target], model, c, prompts, out, seed, lengths)
                spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
                after = {role: prefix_cache_counts(url) for role, url in engines.items()}
                runs.append(
                    {
                        "round": round_index,
                        "target": target,
                        "concurrency": c,
                        "seed": seed,
                        "prefix_cache_hit_share": hit_shares(cached, after),
                        "completed": result["completed"],
                        "output_tokens_per_s": result["output_throughput"],
                        "ttft_p50_ms": result["median_ttft_ms"],
                        "ttft_p99_ms": result["p99_ttft_ms"],
                        "e2el_p50_ms": result["median_e2el_ms"],
                        "duration_s": result["duration"],
                        "output_tokens": result["total_output_tokens"],
                        "ttfts_ms": [t * 1e3 for t in result["ttfts"] if t],
                        "e2els_ms": [t * 1e3 for t in result["latencies"] if t],
                        "router_cpu_s_per_request": (
                            spent[target] / max(result["completed"], 1) if target in spent else None
                        ),
                    }
                )
                print(
                    f"  round {round_index + 1}, c={c}, {target}: "
                    f"{result['output_throughput']:.0f} tok/s, "
                    f"TTFT p99 {result['p99_ttft_ms']:.0f} ms, prefill prefix-cache hits "
                    f"{runs[-1]['prefix_cache_hit_share']['prefill'] or 0:.0%}",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """One (target, concurrency)'s runs as one: tokens over time, percentiles over requests."""
    ttfts = [t for r in runs for t in r["ttfts_ms"]]
    e2els = [t for r in runs for t in r["e2els_ms"]]
    row = {
        "output_tokens_per_s": sum(r["output_tokens"] for r in runs)
        / sum(r["duration_s"] for r in runs),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "e2el_p50_ms": percentile(e2els, 50),
        "requests": len(ttfts),
    }
    cpu = [r["router_cpu_s_per_request"] for r in runs if r.get("router_cpu_s_per_request")]
    if cpu:
        row["router_cpu_ms_per_request"] = statistics.median(cpu) * 1e3
    return row


def tokens_per_s(targets: dict[str, dict[str, float]], target: str) -> float:
    return targets[target]["output_tokens_per_s"]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures per (target, concurrency), and the headline ratios."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for run in runs:
        table.setdefault(str(run["concurrency"]), {}).setdefault(run["target"], {})
    for c, targets in table.items():
        for target in targets:
            targets[target] = pooled(
                [r for r in runs if str(r["concurrency"]) == c and r["target"] == target]
            )
    headline: dict[str, float] = {}
    both = [
        str(c)
        for c in HEADLINE_CONCURRENCY
        if {"ours", "vllm_router"} <= set(table.get(str(c), {}))
    ]
    if both:
        headline["router_vs_vllm_router_throughput"] = min(
            table[c]["ours"]["output_tokens_per_s"] / table[c]["vllm_router"]["output_tokens_per_s"]
            for c in both
        )
        headline["router_vs_vllm_router_p99_ttft"] = max(
            table[c]["ours"]["ttft_p99_ms"] / table[c]["vllm_router"]["ttft_p99_ms"] for c in both
        )
        headline["router_vs_vllm_router_p50_ttft"] = max(
            table[c]["ours"]["ttft_p50_ms"] / table[c]["vllm_router"]["ttft_p50_ms"] for c in both
        )
    alone = [
        str(c)
        for c in HEADLINE_CONCURRENCY
        if {"ours", "decode_alone"} <= set(table.get(str(c), {}))
    ]
    if alone:  # P/D through our router against its decode engine serving alone
        headline["pd_vs_decode_alone_tokens_per_s"] = min(
            tokens_per_s(table[c], "ours") / tokens_per_s(table[c], "decode_alone") for c in alone
        )
    return {"by_concurrency": table, "headline": headline, "per_round": per_round_ratios(runs)}


def per_round_ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Ours / vllm-router within each round, per concurrency: ``throughput`` (output
    tokens/s) and ``p99_ttft``. The two ran minutes apart in the same round, so drift of the
    machine between rounds cancels; the spread says how far one round's luck goes."""
    found: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for run in runs:
        if run["target"] in ("ours", "vllm_router"):
            found.setdefault((run["concurrency"], run["round"]), {})[run["target"]] = run
    ratios: dict[str, dict[str, list[float]]] = {}
    for (c, _), pair in sorted(found.items()):
        if len(pair) < 2:
            continue
        ours, peer = pair["ours"], pair["vllm_router"]
        row = ratios.setdefault(str(c), {"throughput": [], "p99_ttft": [], "p50_ttft": []})
        row["throughput"].append(ours["output_tokens_per_s"] / peer["output_tokens_per_s"])
        row["p99_ttft"].append(ours["ttft_p99_ms"] / peer["ttft_p99_ms"])
        row["p50_ttft"].append(percentile(ours["ttfts_ms"], 50) / percentile(peer["ttfts_ms"], 50))
    return ratios


def warm_up(url: str, model: str) -> None:
    """One request through P/D: the engines' first NIXL handshake stays out of the runs."""
    body = {"model": model, "prompt": "warm up the transfer path", "max_tokens": 4}
    httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()


def prompts_for(concurrency: int, per_slot: int) -> int:
    """Prompts in one run: ``per_slot`` per concurrent request, at least 16 (so a p99 is
    more than one request's luck, and one request at a time does not take minutes)."""
    return max(16, per_slot * concurrency)


def run_on(
    urls: dict[str, str],
    router_pid: int,
    model: str,
    work: Path,
    concurrency: list[int],
    rounds: int,
    per_slot: int,
    warm_up_round: bool = True,
) -> dict[str, Any]:
    """The comparison on a running stack (:func:`bench.end_to_end.start_stack`'s ``urls``
    and router PID): vllm-router is started in front of the same engines, and stopped."""
    peer = None
    try:
        peer, peer_url = start_vllm_router(urls["prefill"], urls["decode"], work / "vr.log")
        targets = {"ours": urls["router"], "vllm_router": peer_url, "decode_alone": urls["decode"]}
        engines = {role: urls[role] for role in ("prefill", "decode")}
        pids = {"ours": router_pid, "vllm_router": peer.pid}
        warm_up(targets["ours"], model)
        # An untimed round first (prompts of its own): whichever target runs first at a
        # concurrency would otherwise meet the engines' first batches of that size.
        if warm_up_round:
            print("  warm-up round (not counted)", file=sys.stderr, flush=True)
            measure(targets, engines, pids, model, concurrency, range(rounds, rounds + 1), 2, work)
        runs = measure(targets, engines, pids, model, concurrency, range(rounds), per_slot, work)
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait(timeout=20)
    prompts = {str(c): prompts_for(c, per_slot) for c in concurrency}
    return {"prompts": prompts, "rounds": rounds, "runs": runs, **summarize(runs)}


def run(
    concurrency: list[int],
    rounds: int,
    per_slot: int,
    warm_up_round: bool = True,
    confine_engines: bool = True,
) -> dict[str, Any]:
    """:func:`run_on` on a stack of its own, started and stopped here; ``confine_engines``
    False starts the engines as a plain ``vllm serve`` would (no core of their own)."""
    with tiny_stack(confine_cores=confine_engines) as stack:
        return run_on(
            stack.urls,
            stack.router_pid,
            stack.model,
            stack.work,
            concurrency,
            rounds,
            per_slot,
            warm_up_round,
        ) | {"engines_confined": confine_engines}


def table(result: dict[str, Any]) -> str:
    """The comparison as Markdown: every round pooled, per concurrency and target."""
    lines = [
        "| router comparison: concurrent | target | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| E2E p50 ms | router CPU ms / request |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, targets in result["by_concurrency"].items():
        for target, row in targets.items():
            cpu = row.get("router_cpu_ms_per_request")
            lines.append(
                f"| {c} | {target} | {row['output_tokens_per_s']:.0f} | "
                f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['e2el_p50_ms']:.0f} "
                f"| {'' if cpu is None else f'{cpu:.1f}'} |"
            )
    rounds = result.get("per_round", {})
    if rounds:
        lines += [
            "",
            "| ours / vllm-router, round by round: concurrent | throughput | TTFT p99 | TTFT p50 |",
            "|---|---|---|---|",
        ]
        for c, row in rounds.items():
            cells = [" ".join(f"{x:.2f}" for x in row.get(key, [])) for key in RATIO_KEYS]
            lines.append(f"| {c} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Throughput and p99 TTFT against concurrency, one line per target (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    levels = sorted(result["by_concurrency"], key=int)
    for target in TARGETS:
        rows = [result["by_concurrency"][c].get(target) for c in levels]
        xs = [int(c) for c, row in zip(levels, rows, strict=True) if row]
        rows = [row for row in rows if row]
        axes[0].plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label=target)
        axes[1].plot(xs, [r["ttft_p99_ms"] for r in rows], "o-", label=target)
    axes[0].set(xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    axes[1].set(xlabel="concurrent requests", ylabel="TTFT p99 (ms)", title="Tail TTFT")
    axes[1].set_yscale("log")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-slot", type=int, default=12)
    parser.add_argument("--out", default=str(RESULTS), help="where results are written")
    parser.add_argument(
        "--no-warm-up-round",
        dest="warm_up_round",
        action="store_false",
        help="skip the untimed round (for a check that it runs, not for figures)",
    )
    parser.add_argument(
        "--unconfined-engines",
        dest="confine_engines",
        action="store_false",
        help="start the engines as a plain vllm serve would, without a core each; results "
        "go to router_peer_unconfined.json and headline keys ending in _unconfined",
    )
    args = parser.parse_args()
    result = run(
        args.concurrency,
        args.rounds,
        args.prompts_per_slot,
        args.warm_up_round,
        args.confine_engines,
    )
    print(table(result))
    suffix = "" if args.confine_engines else "_unconfined"
    headline = {f"{key}{suffix}": value for key, value in result["headline"].items()}
    print(json.dumps(headline))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"router_peer{suffix}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"router_peer{suffix}.png")
    refresh_latest(headline, out / "latest.json", section=f"router_peer{suffix}")
    return 0


def refresh_latest(headline: dict[str, Any], path: Path, section: str = "router_peer") -> None:
    """Put one section's headline into ``latest.json``, with ``{section}_date`` and
    ``{section}_commit`` beside it; the file's other keys stay."""
    import datetime as dt

    from bench.__main__ import commit

    latest = json.loads(path.read_text()) if path.exists() else {}
    latest.update(headline)
    latest[f"{section}_date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    latest[f"{section}_commit"] = commit()
    path.write_text(json.dumps(latest, indent=2))


if __name__ == "__main__":
    sys.exit(main())
