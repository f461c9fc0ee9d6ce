"""KV transfer between registered workers: our worker's caches against the stock worker's.

Two workers of one class (prefill and decode), in a fresh process for each pair, register
the same real caches (vLLM's KVCacheConfig for the tiny sliding-window hybrid) with real
NIXL agents; the decode worker READs every block of the prefill's from the descriptors each
advertises in its handshake, as vLLM's read path does. Ours and stock alternate, round after
round, so machine noise hits both alike. ``transfer_ours_vs_stock``: our throughput /
stock's (1.0 = our registration costs the transfer nothing).

    python -m bench.worker_transfer [--cache-mib 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
READS_PER_PAIR = 5


def _worker(cls: type, setup: Any) -> Any:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(setup.vllm_config):
        return cls(setup.vllm_config, str(uuid.uuid4()), setup.kv_cache_config)


def _timed_reads(
    decode: Any, prefill: Any, blocks: list[int], reads: int, harness: Any
) -> tuple[int, float]:
    """Bytes and seconds per READ of ``blocks`` (median of ``reads``), descriptors built once
    from what each worker advertises, as vLLM's read path builds them."""
    remote, local = harness.advertised_metadata(prefill), harness.advertised_metadata(decode)
    agent = decode.nixl_wrapper
    remote_name = agent.add_remote_agent(remote.agent_metadata)
    src = harness._block_descs(
        remote.kv_caches_base_addr, remote.block_lens, harness._strides(remote), blocks
    )
    dst = harness._block_descs(
        local.kv_caches_base_addr, local.block_lens, harness._strides(local), blocks
    )
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs(dst, "DRAM"), agent.get_xfer_descs(src, "DRAM"), remote_name
    )
    seconds = []
    try:
        for _ in range(reads):
            started = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
            seconds.append(time.perf_counter() - started)
    finally:
        agent.release_xfer_handle(handle)
        agent.remove_remote_agent(remote_name)
    return int(dst[:, 1].sum()), statistics.median(seconds)


def _one_pair(cls: type, setup: Any, harness: Any, reads: int) -> tuple[int, float]:
    """Bytes per READ of every block between two fresh workers, and its seconds."""
    prefill, decode = _worker(cls, setup), _worker(cls, setup)
    try:
        src = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=1)
        dst = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=None)
        prefill.register_kv_caches(src.views)
        decode.register_kv_caches(dst.views)
        blocks = list(range(1, setup.kv_cache_config.num_blocks))
        return _timed_reads(decode, prefill, blocks, reads, harness)
    finally:
        prefill.shutdown()
        decode.shutdown()


def one_pair(name: str, model: str, cache_mib: int) -> dict[str, float]:
    """One pair of ``name`` (ours | stock) workers: bytes and seconds per READ."""
    from tests.harness import worker_harness as harness
    from vllm_hybrid_nixl.connector import compat
    from vllm_hybrid_nixl.connector.worker import HybridNixlPullWorker

    classes = {"ours": HybridNixlPullWorker, "stock": compat.nixl_classes().pull_worker}
    with harness.model_setup(model, kv_cache_bytes=cache_mib << 20) as setup:
        moved, seconds = _one_pair(classes[name], setup, harness, READS_PER_PAIR)
    return {"bytes": moved, "seconds": seconds}


def _pair_in_fresh_process(name: str, model: str, cache_mib: int) -> dict[str, float]:
    """:func:`one_pair` in a process of its own: NIXL agents of earlier pairs keep their
    busy progress threads in a process after the workers shut down, and starved the next
    pair's transfers (measured: 0.01 GB/s after a stock pair, 2 GB/s before)."""
    command = [
        sys.executable, "-m", "bench.worker_transfer", "--one-pair", name,
        "--model", model, "--cache-mib", str(cache_mib),
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"worker transfer ({name}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(cache_mib: int, repeats: int, workdir: Path) -> dict[str, Any]:
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    model = str(build_tiny_model(workdir / "transfer-model", TinyModelSpec()))
    rates: dict[str, list[float]] = {"ours": [], "stock": []}
    moved = 0
    for round_index in range(repeats):
        order = ("ours", "stock") if round_index % 2 == 0 else ("stock", "ours")
        for name in order:
            pair = _pair_in_fresh_process(name, model, cache_mib)
            moved = int(pair["bytes"])
            rates[name].append(moved / pair["seconds"] / 1e9)
        print(
            f"  worker READ of {moved >> 20} MiB: ours {rates['ours'][-1]:.2f} GB/s, "
            f"stock {rates['stock'][-1]:.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )
    ours, stock = statistics.median(rates["ours"]), statistics.median(rates["stock"])
    return {
        "bytes": moved,
        "reads_per_pair": READS_PER_PAIR,
        "ours_gbs": ours,
        "stock_gbs": stock,
        "ratio": ours / stock,
    }


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one-pair", choices=["ours", "stock"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_pair:  # the child of _pair_in_fresh_process
        print(json.dumps(one_pair(args.one_pair, args.model, args.cache_mib)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.cache_mib, args.repeats, Path(tmp))
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "worker_transfer.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
