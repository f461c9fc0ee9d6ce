"""KV transfer throughput: NIXL READ between two processes on this machine against memcpy of
the same bytes, per block size, and the cost of the HMA forms (r physical blocks per logical
block) — side by side in one run.

A *holder* process (the prefill side) registers a DRAM buffer with its NIXL agent; the bench
process (the decode side) registers its own and READs from it, the way vLLM's worker does:
descriptor lists prepared once (``prep_xfer_dlist``), transfers made from block indices
(``make_prepped_xfer``). memcpy: one ``torch`` copy of the same bytes in one process (the
limit a transfer on one host can reach).

    python -m bench.transfer [--total-mib 64] [--repeats 5] [--smoke]

``--compare-ucx`` runs the same measurement once per UCX transport choice (``UCX_TLS``), each
in a fresh process, to show which transport UCX picks on one host and what each delivers.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
# UCX transport choices compared by --compare-ucx: None leaves UCX to pick (what engines do).
UCX_CHOICES = [None, "tcp,self", "sm,tcp,self", "posix,tcp,self", "cma,tcp,self", "posix,self"]


def _agent(name: str):
    """A NIXL agent whose progress thread waits for transport events, as our worker builds
    them on CPU engines (``progress_poll_us``): with two agents spinning on two cores, memcpy
    itself fell to a tenth of its speed and both figures meant nothing."""
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_hybrid_nixl.connector.progress_pacing import DEFAULT_POLL_US, paced_agents

    with paced_agents(nixl_agent, DEFAULT_POLL_US) as paced:
        agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if not paced:
        raise RuntimeError("this NIXL's progress thread cannot be paced; see progress_pacing")
    return agent


def _holder(total: int, conn) -> None:
    """The prefill side: a registered buffer of random bytes, kept until told to stop."""
    import torch

    agent = _agent(f"holder-{uuid.uuid4().hex[:6]}")
    buffer = torch.randint(0, 255, (total,), dtype=torch.uint8)
    agent.register_memory(buffer)
    conn.send((agent.get_agent_metadata(), buffer.data_ptr(), int(buffer[:4096].sum())))
    conn.recv()  # stop


def _wait(agent, handle, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    state = agent.transfer(handle)
    while state != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"NIXL READ ended in state {state}")
        state = agent.check_xfer_state(handle)


def _descs(base: int, total: int, size: int):
    import numpy as np

    count = total // size
    return np.array([(base + i * size, size, 0) for i in range(count)], dtype=np.uint64)


def measure(total: int, repeats: int, block_sizes: list[int], ratios: list[int]) -> dict:
    import torch

    parent, child = mp.get_context("spawn").Pipe()
    holder = mp.get_context("spawn").Process(target=_holder, args=(total, child), daemon=True)
    holder.start()
    agent = registered = remote = None
    try:
        if not parent.poll(120):  # a holder that died (e.g. a UCX transport that cannot run)
            raise RuntimeError(f"the holder process gave no NIXL metadata (exit {holder.exitcode})")
        metadata, remote_base, checksum = parent.recv()
        agent = _agent(f"reader-{uuid.uuid4().hex[:6]}")
        local = torch.zeros(total, dtype=torch.uint8)
        registered = agent.register_memory(local)
        remote = agent.add_remote_agent(metadata)
        memcpy_src = torch.randint(0, 255, (total,), dtype=torch.uint8)
        memcpy_dst = torch.zeros_like(memcpy_src)
        memcpy_dst.copy_(memcpy_src)  # fault every page in before timing
        local.fill_(1)
        rows = []
        for size in block_sizes:
            nixl_s, copy_s, one_core_s = [], [], []
            count = total // size
            local_side = agent.prep_xfer_dlist("", _descs(local.data_ptr(), total, size), "DRAM")
            remote_side = agent.prep_xfer_dlist(remote, _descs(remote_base, total, size), "DRAM")
            indices = list(range(count))
            warm = agent.make_prepped_xfer("READ", local_side, indices, remote_side, indices)
            _wait(agent, warm)  # the first READ sets up the UCX endpoint
            agent.release_xfer_handle(warm)
            for _ in range(repeats):  # alternate, so noise hits both alike
                handle = agent.make_prepped_xfer("READ", local_side, indices, remote_side, indices)
                started = time.perf_counter()
                _wait(agent, handle)
                nixl_s.append(time.perf_counter() - started)
                agent.release_xfer_handle(handle)
                # The anchor is the machine's copy bandwidth: the same bytes in one copy (a
                # Python loop of per-block copies would measure the loop, not memory).
                started = time.perf_counter()
                memcpy_dst.copy_(memcpy_src)
                copy_s.append(time.perf_counter() - started)
                # ... and on one core, as UCX's single-copy transport (cma) moves bytes
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                started = time.perf_counter()
                memcpy_dst.copy_(memcpy_src)
                one_core_s.append(time.perf_counter() - started)
                torch.set_num_threads(threads)
            if int(local[:4096].sum()) != checksum:
                raise RuntimeError("NIXL READ did not bring the holder's bytes")
            nixl_gbs = total / statistics.median(nixl_s) / 1e9
            copy_gbs = total / statistics.median(copy_s) / 1e9
            one_core_gbs = total / statistics.median(one_core_s) / 1e9
            rows.append(
                {
                    "block_bytes": size,
                    "descriptors": count,
                    "nixl_gbs": nixl_gbs,
                    "memcpy_gbs": copy_gbs,
                    "ratio": nixl_gbs / copy_gbs,
                    "memcpy_one_core_gbs": one_core_gbs,
                    "ratio_one_core": nixl_gbs / one_core_gbs,
                }
            )
            print(
                f"  {size >> 10:>5} KiB blocks: NIXL {nixl_gbs:.2f} GB/s, memcpy "
                f"{copy_gbs:.2f} GB/s ({nixl_gbs / copy_gbs:.2f}x)",
                file=sys.stderr,
                flush=True,
            )
            agent.release_dlist_handle(local_side)
            agent.release_dlist_handle(remote_side)
        forms = _forms(agent, remote, local, remote_base, total, repeats, ratios)
    finally:
        if agent is not None:  # its progress thread spins until the agent is gone
            if remote is not None:
                agent.remove_remote_agent(remote)
            if registered is not None:
                agent.deregister_memory(registered)
            del agent
            gc.collect()
        parent.send("stop")
        holder.join(timeout=30)
    return {"total_bytes": total, "blocks": rows, "forms": forms}


def _forms(agent, remote, local, remote_base, total, repeats, ratios) -> list[dict]:
    """One logical block of 256 KiB as r physical blocks of 256/r KiB (the [NB*r, PS/r] form):
    descriptors and time per logical block, with NIXL merging adjacent descriptors (its
    default) and without."""
    logical = 256 << 10
    count = total // logical
    rows = []
    for ratio in ratios:
        size = logical // ratio
        local_side = agent.prep_xfer_dlist("", _descs(local.data_ptr(), total, size), "DRAM")
        remote_side = agent.prep_xfer_dlist(remote, _descs(remote_base, total, size), "DRAM")
        indices = list(range(count * ratio))
        for merge in (True, False):
            times = []
            for _ in range(repeats):
                handle = agent.make_prepped_xfer(
                    "READ", local_side, indices, remote_side, indices, skip_desc_merge=not merge
                )
                started = time.perf_counter()
                _wait(agent, handle)
                times.append(time.perf_counter() - started)
                agent.release_xfer_handle(handle)
            rows.append(
                {
                    "r": ratio,
                    "descriptors_per_logical_block": ratio,
                    "nixl_merges_adjacent": merge,
                    "us_per_logical_block": statistics.median(times) / count * 1e6,
                }
            )
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)
    return rows


def compare_ucx(
    total: int, repeats: int, block_sizes: list[int], choices: list[str | None]
) -> list[dict]:
    """One fresh process per ``UCX_TLS`` choice (UCX reads it once, at start): NIXL and memcpy
    GB/s per block size, or the error when that transport cannot run here."""
    rows = []
    for choice in choices:
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if choice is not None:
            env["UCX_TLS"] = choice
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            sizes = [str(size) for size in block_sizes]
            command = [sys.executable, "-m", "bench.transfer", "--total-mib", str(total >> 20)]
            command += ["--repeats", str(repeats), "--block-bytes", *sizes, "--json", str(out)]
            row: dict = {"ucx_tls": choice or "(UCX picks)"}
            try:
                done = subprocess.run(
                    command,
                    env=env,
                    cwd=Path(__file__).parent.parent,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            except subprocess.TimeoutExpired:
                row["error"] = "did not finish within 300 s"
            else:
                if done.returncode == 0:
                    row["blocks"] = json.loads(out.read_text())["blocks"]
                    row["median_ratio"] = statistics.median(b["ratio"] for b in row["blocks"])
                else:
                    row["error"] = (done.stderr.strip().splitlines() or ["exit code"])[-1][-300:]
        print(
            f"  UCX_TLS={row['ucx_tls']}: "
            + (f"{row['median_ratio']:.2f}x memcpy" if "blocks" in row else row["error"]),
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="4 MiB, 2 block sizes, 1 repeat")
    parser.add_argument("--block-bytes", type=int, nargs="+", help="block sizes to measure")
    parser.add_argument("--json", help="write the result here (else under results/)")
    parser.add_argument(
        "--compare-ucx", action="store_true", help="once per UCX transport choice (UCX_TLS)"
    )
    args = parser.parse_args(argv)
    if args.compare_ucx:
        rows = compare_ucx(args.total_mib << 20, args.repeats, BLOCK_SIZES, UCX_CHOICES)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "transfer_ucx.json").write_text(json.dumps(rows, indent=2))
        return 0
    if args.block_bytes:
        result = measure(args.total_mib << 20, args.repeats, args.block_bytes, [])
    elif args.smoke:
        result = measure(4 << 20, 1, [64 << 10, 1 << 20], [1, 2])
    else:
        result = measure(args.total_mib << 20, args.repeats, BLOCK_SIZES, [1, 2, 4])
    result["ucx_tls"] = os.environ.get("UCX_TLS", "(default)")
    print(f"{'block':>8} {'descs':>6} {'NIXL GB/s':>10} {'memcpy GB/s':>12} {'ratio':>6}")
    for row in result["blocks"]:
        print(
            f"{row['block_bytes'] >> 10:>6}Ki {row['descriptors']:>6} {row['nixl_gbs']:>10.2f} "
            f"{row['memcpy_gbs']:>12.2f} {row['ratio']:>6.2f}"
        )
    print(f"{'r':>3} {'merge':>6} {'us/logical block':>17}")
    for row in result["forms"]:
        print(
            f"{row['r']:>3} {row['nixl_merges_adjacent']!s:>6} {row['us_per_logical_block']:>17.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        return 0
    RESULTS.mkdir(exist_ok=True)
    name = "transfer_smoke.json" if args.smoke else "transfer.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
