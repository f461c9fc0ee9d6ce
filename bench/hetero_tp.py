"""Hybrid models with a different tensor-parallel size on each side: what stock
``NixlConnector`` and ``HybridNixlConnector`` do, measured with real engines.

    python -m bench.hetero_tp [--cases stock:nemotron-h-g1:1:2 ...] [--max-tokens 12]

For each case (connector, model, prefill TP, decode TP[, prefill and decode block size, 64
by default: ``stock:llama-hybrid:1:1:64:32``]) a prefill and a decode ``vllm serve``
start on this machine's two cores (vLLM's CPU build runs TP=2 as one worker per core), a few
greedy prompts (one block, several blocks) run P/D, and each answer is compared with both
engines answering alone. Outcome per case: ``served`` (every P/D answer equals one engine's
alone, token for token), ``wrong`` (HTTP 200 with other tokens), ``refused`` (an engine did
not start, or a leg failed; the first error line is kept). Writes ``hetero_tp.json`` under
``bench/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.end_to_end import RESULTS
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec, stop_engines
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

CONNECTORS = {"stock": "NixlConnector", "ours": "HybridNixlConnector"}
MODELS = {
    "llama": TinyModelSpec("llama"),
    "llama-hybrid": TinyModelSpec("llama-hybrid"),  # sliding window + full attention
    "nemotron-h-g1": TinyModelSpec("nemotron-h"),  # Mamba2, n_groups 1: TP replicates B/C
    "nemotron-h-g2": TinyModelSpec("nemotron-h", mamba_groups=2),  # TP2 splits B/C
    # one KV head: a TP2 engine holds it on both ranks (replicated), a TP1 engine once
    "llama-hybrid-kv1": TinyModelSpec("llama-hybrid", kv_heads=1),
}
DEFAULT_CASES = [
    "stock:nemotron-h-g2:1:2",
    "stock:nemotron-h-g1:1:2",
    "stock:llama-hybrid:1:2",
    "stock:nemotron-h-g2:2:1",
    "stock:llama-hybrid:2:1",
    "ours:nemotron-h-g2:1:2",
]
WORDS = "the decode engine splits its state over two ranks"
PROMPTS = [f"tp {i}: " + " ".join([WORDS] * n) for i, n in enumerate([1, 8, 20])]
#: ``--more-prompts``: other lengths and words, for a case whose outcome one prompt decides.
MORE_PROMPTS = [
    f"more {i}: " + " ".join([f"{WORDS} {i} and {j}" for j in range(n)])
    for i, n in enumerate([3, 6, 9, 12, 15])
]
ERROR_LINE = re.compile(r"(Error|error|refus|mismatch|not supported)[^\n]{0,300}")


def _spec(model: Path, role: str, tp: int, connector: str, block_size: int = 64) -> EngineSpec:
    args = ["--enforce-eager", "--max-model-len", "1024", "--block-size", str(block_size)]
    spec = EngineSpec(
        model=str(model), port=free_port(), role=role, connector=connector,
        side_channel_port=free_side_channel_port(), extra_args=args,
        kv_extra_config={"lease_check_timeout": 30.0} if connector != "NixlConnector" else {},
    )  # fmt: skip
    if tp > 1:
        spec.extra_args += ["--tensor-parallel-size", str(tp)]
        spec.env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
    else:
        spec.cpu_core = 0 if role == "prefill" else 1
    return spec


def _tp_of(spec: EngineSpec) -> int:
    args = spec.extra_args
    flag = "--tensor-parallel-size"
    return int(args[args.index(flag) + 1]) if flag in args else 1


def _lowest_priority(engine: EngineProcess) -> None:
    """Nice 19 for every process of ``engine`` (CPU scheduling only; nothing it computes)."""
    if engine.process is None:
        return
    root = psutil.Process(engine.process.pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            process.nice(19)


EXCEPTION_LINE = re.compile(r"\b\w+(Error|Exception): ")


def _first_error(log: str) -> str:
    """The first exception an engine logged (``AssertionError: ...``), else the last line
    that says what failed (warnings left out)."""
    lines = [
        line for line in log.splitlines()
        if "WARNING" not in line and ERROR_LINE.search(line)
    ]  # fmt: skip
    raised = [line for line in lines if EXCEPTION_LINE.search(line)]
    if raised:
        return raised[0].strip()[:400]
    return (lines[-1] if lines else log[-300:]).strip()[:400]


def _answer(choice: dict) -> list[int] | str:
    return choice.get("token_ids") or choice["text"]


def _divergence(pd: list[int] | str, alone: list[int] | str, choice: dict) -> dict[str, Any]:
    """Where a P/D answer first leaves the prefill engine's own, and how close that engine's
    top two candidates were there (a gap near 0 is a numeric near tie, not a wrong read)."""
    if pd == alone or isinstance(pd, str) or isinstance(alone, str):
        return {}
    index = next((i for i, (a, b) in enumerate(zip(pd, alone, strict=False)) if a != b), None)
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    if index is None or index >= len(tops) or len(tops[index]) < 2:
        return {"first_difference": index}
    best, second = sorted(tops[index].values(), reverse=True)[:2]
    return {"first_difference": index, "prefill_alone_top2_gap": round(best - second, 5)}


def run_case(
    case: str, models: dict[str, Path], max_tokens: int, logs: Path, prompts: list[str]
) -> dict[str, Any]:
    who, model_name, p_tp, d_tp, *blocks = case.split(":")
    p_block, d_block = (int(b) for b in blocks) if blocks else (64, 64)
    connector = CONNECTORS[who]
    specs = [
        _spec(models[model_name], "prefill", int(p_tp), connector, p_block),
        _spec(models[model_name], "decode", int(d_tp), connector, d_block),
    ]
    engines = [EngineProcess(s, logs / f"{case.replace(':', '-')}-{s.role}.log") for s in specs]
    result: dict[str, Any] = {"case": case, "connector": connector, "model": model_name}
    result.update(prefill_tp=int(p_tp), decode_tp=int(d_tp), answers=[])
    result.update(prefill_block_size=p_block, decode_block_size=d_block)
    started = time.monotonic()
    try:
        # the smaller TP first, healthy before the other starts: on two cores a single-rank
        # engine starting beside two busy-polling NIXL ranks did not come up in 5 minutes
        for engine in sorted(engines, key=lambda e: _tp_of(e.spec)):
            engine.start()
            try:
                engine.wait_healthy(timeout_s=420)
            except Exception:  # noqa: BLE001 - any start failure is this case's outcome
                result.update(outcome="refused", at="start", why=_first_error(engine.log_text()))
                return result
        if connector == "NixlConnector":
            # stock's NIXL progress threads spin at full priority: a multi-rank stock engine
            # left the single-rank engine on its core nothing (requests stalled for minutes)
            for engine in engines:
                if _tp_of(engine.spec) > 1:
                    _lowest_priority(engine)
                    result["niced"] = engine.spec.role
        try:
            _ask_every_prompt(result, engines, models[model_name], prompts, max_tokens)
        except httpx.HTTPError as exc:  # an engine that never answers is this case's outcome
            result.update(outcome="no_answer", at="request", why=f"{type(exc).__name__}: {exc}")
            return result
        if result.get("outcome"):
            return result
        same = all(a["equals_prefill_alone"] or a["equals_decode_alone"] for a in result["answers"])
        moved_kv = all(a["nixl_bytes"] > 0 for a in result["answers"])
        result["outcome"] = "served" if same and moved_kv else ("wrong" if moved_kv else "no_kv")
        return result
    finally:
        stop_engines(engines)
        result["seconds"] = round(time.monotonic() - started, 1)


def _ask_every_prompt(
    result: dict[str, Any],
    engines: list[EngineProcess],
    model: Path,
    prompts: list[str],
    max_tokens: int,
) -> None:
    """Each prompt to both engines alone and through P/D; answers go to ``result``; a failed
    leg sets the outcome "refused" and stops."""
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {"model": str(model), "prompt": prompt}
            body.update(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            body["return_token_ids"] = True
            alone_choices = [
                client.post(f"{e.spec.url}/v1/completions", json={**body, "logprobs": 2})
                .json()["choices"][0]
                for e in engines
            ]  # fmt: skip
            alone = [_answer(choice) for choice in alone_choices]
            before = read_kv_transfer_counters(engines[1].spec.url, client)
            try:
                done = disaggregated_completion(
                    client, engines[0].spec.url, engines[1].spec.url, body
                )
            except LegError as exc:
                result["answers"].append({"prompt_words": len(prompt.split()), "error": str(exc)})
                result.update(
                    outcome="refused", at="request", why=_first_error(engines[1].log_text())
                )
                return
            moved = read_kv_transfer_counters(engines[1].spec.url, client) - before
            pd = _answer(done.decode_response["choices"][0])
            result["answers"].append(
                {
                    "prompt_words": len(prompt.split()),
                    "equals_prefill_alone": pd == alone[0],
                    "equals_decode_alone": pd == alone[1],
                    "engines_alone_agree": alone[0] == alone[1],
                    "nixl_bytes": moved.nixl_bytes,
                    **_divergence(pd, alone[0], alone_choices[0]),
                }
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--more-prompts", action="store_true", help="5 more prompts a case")
    parser.add_argument("--out", type=Path, default=RESULTS / "hetero_tp.json")
    args = parser.parse_args()
    # Cases measured before and not rerun now are kept (the file is the table's source).
    kept = json.loads(args.out.read_text())["cases"] if args.out.exists() else []
    results = {item["case"]: item for item in kept}
    with tempfile.TemporaryDirectory() as raw:
        tmp = Path(raw)
        names = {case.split(":")[1] for case in args.cases}
        models = {name: build_tiny_model(tmp / name, MODELS[name]) for name in names}
        for case in args.cases:
            print(f"case {case} ...", file=sys.stderr, flush=True)
            prompts = PROMPTS + (MORE_PROMPTS if args.more_prompts else [])
            result = run_case(case, models, args.max_tokens, tmp, prompts)
            print(f"  {result['outcome']}: {result.get('why', '')}", file=sys.stderr, flush=True)
            results[case] = result
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"cases": list(results.values())}, indent=2) + "\n")
    for r in results.values():
        print(f"{r['case']:>28}: {r['outcome']} {r.get('why', '')[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
