"""Registration cost: ``register_kv_caches`` of our worker vs vLLM's stock NIXL worker.

Both register the same real caches (vLLM's KVCacheConfig for tiny hybrid models of 8, 64
and 256 layers: sliding window + full attention, and a Mamba2 hybrid, NemotronH, whose
Mamba layers register their conv and SSM state per block) with real NIXL agents; runs
alternate ours/stock so machine noise hits both alike. Reported as the ratio of medians
(ours / stock), and the shares of ours taken by the layout check and by the registration
audit (vLLM's descriptors of sampled blocks compared with the checked layout).

    python -m bench.registration_cost [--layers 8 64 256] [--mamba-layers 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MAMBA_ARCH = "nemotron-h"


def measure(
    layers: int, repeats: int, workdir: Path, arch: str = "llama-hybrid"
) -> dict[str, float | int | str]:
    # Mamba state moves over NIXL only in the DS conv layout (our launchers set it for
    # engines); harmless for attention-only models. Set before vLLM reads it.
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    from tests.harness import worker_harness as harness
    from vllm_hybrid_nixl.connector.worker import HybridNixlPullWorker
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    if arch == "llama-hybrid":
        spec = TinyModelSpec(layers=layers, hidden=64, heads=2, kv_heads=1)
    else:
        spec = TinyModelSpec(arch=arch, layers=layers)
    model = build_tiny_model(workdir / f"{arch}-{layers}", spec)
    times: dict[str, list[float]] = {"ours": [], "stock": []}
    check: list[float] = []
    audit: list[float] = []
    with harness.model_setup(str(model), kv_cache_bytes=layers * (1 << 20)) as setup:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=0).views
        for _ in range(repeats):
            for name, cls in (("ours", HybridNixlPullWorker), ("stock", NixlPullConnectorWorker)):
                with set_current_vllm_config(setup.vllm_config):
                    worker = cls(setup.vllm_config, str(uuid.uuid4()), setup.kv_cache_config)
                try:
                    started = time.perf_counter()
                    worker.register_kv_caches(caches)
                    times[name].append(time.perf_counter() - started)
                    if name == "ours":
                        check.append(worker.layout_check_seconds)
                        audit.append(worker.audit_seconds)
                finally:
                    worker.shutdown()
            print(
                f"  {arch}, {layers} layers: ours {times['ours'][-1] * 1e3:.1f} ms, "
                f"stock {times['stock'][-1] * 1e3:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    ours, stock = statistics.median(times["ours"]), statistics.median(times["stock"])
    return {
        "model": arch,
        "layers": layers,
        "ours_ms": ours * 1e3,
        "stock_ms": stock * 1e3,
        "ratio": ours / stock,
        "check_ms": statistics.median(check) * 1e3,
        "check_share": statistics.median(check) / ours,
        "audit_ms": statistics.median(audit) * 1e3,
        "audit_share": statistics.median(audit) / ours,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--mamba-layers", type=int, nargs="*", default=[64])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            rows.append(measure(layers, args.repeats, Path(tmp)))
        for layers in args.mamba_layers:
            rows.append(measure(layers, args.repeats, Path(tmp), arch=MAMBA_ARCH))
    print(
        f"{'model':>12} {'layers':>6} {'ours ms':>9} {'stock ms':>9} {'ratio':>6} "
        f"{'check ms':>9} {'check %':>8} {'audit ms':>9} {'audit %':>8}"
    )
    for row in rows:
        print(
            f"{row['model']:>12} {row['layers']:>6} {row['ours_ms']:>9.1f} {row['stock_ms']:>9.1f} "
            f"{row['ratio']:>6.3f} {row['check_ms']:>9.2f} {row['check_share'] * 100:>7.1f}% "
            f"{row['audit_ms']:>9.2f} {row['audit_share'] * 100:>7.1f}%"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "registration_cost.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
