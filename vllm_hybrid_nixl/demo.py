"""The main job on one machine: a prefill and a decode engine with ``HybridNixlConnector``
serving one request of a tiny local hybrid model, checked against colocated serving."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from vllm_hybrid_nixl.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.pd import disaggregated_completion

DEFAULT_PROMPT = (
    "the router sends the prompt to the prefill engine and the decode engine reads the kv cache"
)


@dataclass
class DemoOptions:
    model: str | None = None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 24
    block_size: int = 64
    prefill_port: int = 8100
    decode_port: int = 8200
    connector: str = "HybridNixlConnector"
    log_dir: str | None = None
    startup_timeout_s: float = 400.0


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def ensure_model(path: str | None) -> str:
    """Use ``path`` if given, else build the tiny hybrid model once under ./models."""
    if path:
        return path
    from vllm_hybrid_nixl.tools.tiny_model import build_tiny_model

    target = Path("models/tiny-llama-hybrid")
    if not (target / "config.json").exists():
        _say(f"building a tiny random-weight hybrid model in {target} ...")
        build_tiny_model(target)
    return str(target)


def run_demo(options: DemoOptions) -> int:
    model = ensure_model(options.model)
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="vllm-hybrid-nixl-demo-"))
    common = ["--enforce-eager", "--max-model-len", "1024", "--block-size", str(options.block_size)]
    prefill = EngineProcess(
        EngineSpec(
            model,
            options.prefill_port,
            "prefill",
            options.connector,
            5600,
            cpu_core=0,
            extra_args=common,
        ),
        log_dir / "prefill.log",
    )
    decode = EngineProcess(
        EngineSpec(
            model,
            options.decode_port,
            "decode",
            options.connector,
            5700,
            cpu_core=1,
            extra_args=common,
        ),
        log_dir / "decode.log",
    )
    try:
        _say(
            f"starting prefill (:{options.prefill_port}) and decode (:{options.decode_port}) "
            f"engines with {options.connector}; logs in {log_dir}"
        )
        started = time.monotonic()
        prefill.start()
        decode.start()
        prefill.wait_healthy(options.startup_timeout_s)
        decode.wait_healthy(options.startup_timeout_s)
        _say(f"both engines healthy after {time.monotonic() - started:.0f}s")
        body = {
            "model": model,
            "prompt": options.prompt,
            "max_tokens": options.max_tokens,
            "temperature": 0.0,
        }
        with httpx.Client(timeout=120.0) as client:
            before = read_kv_transfer_counters(decode.spec.url, client)
            result = disaggregated_completion(client, prefill.spec.url, decode.spec.url, body)
            moved = read_kv_transfer_counters(decode.spec.url, client) - before
            colocated = client.post(f"{prefill.spec.url}/v1/completions", json=body).json()
        colocated_text = colocated["choices"][0]["text"]
        prompt_tokens = result.decode_response["usage"]["prompt_tokens"]
        print(f"prompt:            {options.prompt!r}")
        print(f"P/D output:        {result.text!r}")
        print(f"colocated output:  {colocated_text!r}")
        print(
            f"KV over NIXL:      {moved.external_prompt_tokens:.0f} of {prompt_tokens} prompt "
            f"tokens, {moved.nixl_bytes:.0f} bytes, {moved.failed_transfers:.0f} failed transfers"
        )
        ok = (
            result.text == colocated_text
            and moved.external_prompt_tokens > 0
            and moved.failed_transfers == 0
        )
        print(
            "RESULT: "
            + (
                "OK - P/D output equals colocated output and the KV came over NIXL"
                if ok
                else "MISMATCH - see the engine logs in " + str(log_dir)
            )
        )
        return 0 if ok else 1
    finally:
        _say("stopping engines")
        decode.stop()
        prefill.stop()
