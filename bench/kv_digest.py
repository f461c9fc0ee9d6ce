"""What the end-to-end KV digest costs: its own speed beside a one-core memcpy of the same
pages, and the TTFT of 1k-token prompts through P/D with the digest on vs off, side by side
in one run (requests alternate).

Speed: a :class:`~vllm_hybrid_nixl.connector.kv_digest.PageDigester` over 8 layers of 256
pages of 32 KiB (64 MiB), torch limited to one thread, against ``index_select`` copying the
same pages (the memcpy NIXL's loopback read amounts to).

TTFT: one decode engine (core 1) and two prefill engines (core 0), the tiny sliding-window
hybrid, HybridNixlConnector everywhere (NIXL's progress thread paced, ``progress_poll_us``);
one prefill runs ``kv_digest: true`` (its lease value names its digest port, so the decode
verifies every read), the other ``kv_digest: false`` (the decode logs its reads as
unverified and uses them). Each round sends one prompt of ~1k tokens through each prefill in
turn (order alternating), prefill leg then a decode leg of one token; TTFT is the wall time
of both legs. ``kv_digest_ttft_ratio`` = TTFT p50 on / off.

    python -m bench.kv_digest [--rounds 30]

Writes ``bench/results/kv_digest.json`` and ``kv_digest_ttft_ratio``,
``kv_digest_gb_per_s`` and ``kv_digest_vs_memcpy_one_core`` into ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector.kv_cache_facts import describe_cache
from vllm_hybrid_nixl.connector.kv_digest import PageDigester
from vllm_hybrid_nixl.connector.progress_pacing import DEFAULT_POLL_US, POLL_KEY
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.deploy.pd_client import disaggregated_completion
from vllm_hybrid_nixl.protocol.layout import check_layout
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

RESULTS = Path(__file__).parent / "results"
ARGS = ["--enforce-eager", "--max-model-len", "2048", "--block-size", "64"]
PROMPT_TOKENS = 1000
#: NIXL's progress thread paced on all three engines: busy-polling threads of three engines
#: on two cores made single reads take 80-735 ms here, noise that hid what the digest costs.
PACED = {POLL_KEY: DEFAULT_POLL_US}


def _layers(pages: int, page_bytes: int, count: int):
    layers = []
    for index in range(count):
        cache = torch.randint(-(2**31), 2**31 - 1, (pages, page_bytes // 4), dtype=torch.int32)
        description = describe_cache(
            f"layer.{index}",
            cache,
            spec_kind="full_attention",
            spec_type="FullAttentionSpec",
            group_id=0,
            num_blocks=pages,
            ratio=1,
            page_size=page_bytes,
        )
        layers.append((cache, description))
    validated = check_layout([d for _, d in layers])
    return [(0, cache, item) for (cache, _), item in zip(layers, validated, strict=True)]


def digest_speed(repeats: int = 5) -> dict[str, float]:
    """GB/s of the digest and of copying the same pages, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pages, page_bytes, count = 256, 32 << 10, 8
        layers = _layers(pages, page_bytes, count)
        digester = PageDigester(layers)
        ids = list(np.random.default_rng(0).permutation(pages))
        index = torch.tensor(ids)
        total = pages * page_bytes * count
        digester.digest(0, ids)
        digest_s, copy_s = [], []
        for _ in range(repeats):  # alternating
            started = time.perf_counter()
            digester.digest(0, ids)
            digest_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _, cache, _ in layers:
                cache.index_select(0, index)
            copy_s.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    digest_gbps = total / statistics.median(digest_s) / 1e9
    copy_gbps = total / statistics.median(copy_s) / 1e9
    return {
        "bytes": total,
        "digest_gb_per_s": round(digest_gbps, 2),
        "memcpy_gb_per_s": round(copy_gbps, 2),
        "digest_vs_memcpy_one_core": round(digest_gbps / copy_gbps, 3),
    }


def _prompt(tokenizer, round_index: int, tokens: int = PROMPT_TOKENS) -> str:
    """A prompt unique to ``round_index`` (no prefix-cache hit) of about ``tokens`` tokens."""
    words = [f"round {round_index}:"]
    step = 64
    while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
        words += [f"w{(round_index * 7919 + len(words) + i) % 997}" for i in range(step)]
        if step > 1 and len(tokenizer(" ".join(words))["input_ids"]) > tokens:
            words = words[:-step]
            step = max(1, step // 4)
    return " ".join(words)


def ttft(rounds: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="bench-digest-"))
    model = build_tiny_model(work / "model", TinyModelSpec())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    specs = {
        name: EngineSpec(
            model=str(model),
            port=free_port(),
            role=role,
            side_channel_port=free_side_channel_port(),
            cpu_core=core,
            extra_args=list(ARGS),
            kv_extra_config=extra,
        )
        for name, role, core, extra in (
            ("on", "prefill", 0, {"kv_digest": True, **PACED}),
            ("off", "prefill", 0, {"kv_digest": False, **PACED}),
            ("decode", "decode", 1, dict(PACED)),
        )
    }
    engines = {name: EngineProcess(spec, work / f"{name}.log") for name, spec in specs.items()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    tokens = 0
    try:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            engine.wait_healthy(timeout_s=600)
        decode_url = specs["decode"].url
        with httpx.Client(timeout=300) as client:
            for warm in ("on", "off"):
                body = {"model": str(model), "prompt": _prompt(tokenizer, -1), "max_tokens": 1}
                disaggregated_completion(client, specs[warm].url, decode_url, body)
            for index in range(rounds):
                order = ("on", "off") if index % 2 == 0 else ("off", "on")
                for arm in order:
                    body = {
                        "model": str(model),
                        "prompt": _prompt(tokenizer, index * 2 + (arm == "on")),
                        "max_tokens": 1,
                        "temperature": 0.0,
                    }
                    started = time.perf_counter()
                    result = disaggregated_completion(client, specs[arm].url, decode_url, body)
                    times[arm].append(time.perf_counter() - started)
                    tokens = result.decode_response["usage"]["prompt_tokens"]
                print(f"round {index + 1}/{rounds}", file=sys.stderr, flush=True)
        decode_log = engines["decode"].log_text()
    finally:
        for engine in engines.values():
            engine.stop()
    p50 = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "rounds": rounds,
        "prompt_tokens": tokens,
        "ttft_ms_p50": {arm: round(v * 1e3, 1) for arm, v in p50.items()},
        "kv_digest_ttft_ratio": round(p50["on"] / p50["off"], 3),
        "verified_reads_logged": "are verified byte for byte" in decode_log,
        "mismatches_logged": decode_log.count("KV digest mismatch"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--speed-only", action="store_true")
    args = parser.parse_args()
    result: dict[str, object] = {"speed": digest_speed()}
    print(json.dumps(result, indent=2), flush=True)
    if not args.speed_only:
        result["ttft"] = ttft(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_digest.json").write_text(json.dumps(result, indent=2) + "\n")
    latest_path = args.out / "latest.json"
    latest = json.loads(latest_path.read_text()) if latest_path.exists() else {}
    speed = result["speed"]
    assert isinstance(speed, dict)
    latest["kv_digest_gb_per_s"] = speed["digest_gb_per_s"]
    latest["kv_digest_vs_memcpy_one_core"] = speed["digest_vs_memcpy_one_core"]
    if "ttft" in result:
        latest["kv_digest_ttft_ratio"] = result["ttft"]["kv_digest_ttft_ratio"]  # type: ignore[index]
    latest_path.write_text(json.dumps(latest, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
