"""The main job on one machine: a tiny hybrid model served 1P1D on a local Ray cluster with
``HybridNixlConnector``, a few prompts through the router, each answer checked against a
colocated (non-disaggregated) run of the same prompt.

The colocated reference is the prefill engine itself answering a plain request (no
``kv_transfer_params``: it prefills and decodes locally, as any vLLM engine does) under a
cache salt of its own, so it never reuses KV the P/D leg left in its prefix cache. That saves
starting a third engine on a small machine."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.ray.config import make_config
from vllm_hybrid_nixl.deploy.ray.deployment import PDDeployment

WORDS = "the router sends each prompt to a prefill engine and the decode engine reads its kv cache"
# Lengths chosen around the 64-token sliding window and 64-token blocks.
PROMPT_REPEATS = (1, 2, 4, 5, 7, 9, 12, 16)
# Keeps the colocated reference's prefix cache apart from the P/D prefill leg's.
COLOCATED_SALT = "vllm-hybrid-nixl-demo-colocated-reference"


def demo_prompts() -> list[str]:
    # Distinct first words, so no prompt is a prefix-cache hit of another.
    return [f"prompt {i}: " + " ".join([WORDS] * n) for i, n in enumerate(PROMPT_REPEATS)]


@dataclass
class DemoOptions:
    model: str | None = None
    max_tokens: int = 24
    block_size: int = 64
    log_dir: str | None = None
    startup_timeout_s: float = 900.0
    prompts: list[str] = field(default_factory=demo_prompts)


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
        started = time.perf_counter()
        build_tiny_model(target)
        _say(f"built the model in {time.perf_counter() - started:.1f}s")
    return str(target.resolve())


def stream_timing(client: httpx.Client, url: str, body: dict) -> tuple[float, float, int]:
    """(time to first token, output tokens/s after it, tokens) of one streamed completion."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{url}/v1/completions", json=stream_body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None or tokens == 0:
        raise RuntimeError(f"no tokens streamed from {url}")
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return first - started, rate, tokens


def run_demo(options: DemoOptions) -> int:
    # The demo serves a model built here: nothing to download, so engines must not try
    # (engines started for real deployments keep the hub reachable).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wall = time.perf_counter()
    model = ensure_model(options.model)
    setup_s = time.perf_counter() - wall
    log_dir = options.log_dir or tempfile.mkdtemp(prefix="vllm-hybrid-nixl-demo-")
    config = make_config(
        model=model,
        num_prefill=1,
        num_decode=1,
        block_size=options.block_size,
        max_model_len=1024,
        enforce_eager=True,
        router_port=0,
        log_dir=log_dir,
        startup_timeout_s=options.startup_timeout_s,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    started = time.perf_counter()
    _say("starting 1 prefill + 1 decode engine on Ray")
    with PDDeployment(config) as deployment:
        engines_s = time.perf_counter() - started
        _say(f"engines and router ready in {engines_s:.0f}s; sending the prompts")
        print(f"router: {deployment.router_url}", flush=True)
        return _serve_and_compare(options, model, deployment, setup_s, engines_s)


def _serve_and_compare(
    options: DemoOptions,
    model: str,
    deployment: PDDeployment,
    setup_s: float,
    engines_s: float,
) -> int:
    serving = time.perf_counter()
    decode_url = deployment.urls("decode")[0]
    colocated_url = deployment.urls("prefill")[0]
    with httpx.Client(timeout=120.0) as client:
        before = read_kv_transfer_counters(decode_url, client)
        all_match, prompt_tokens = _compare_answers(
            client, options, model, deployment.router_url, colocated_url
        )
        moved = read_kv_transfer_counters(decode_url, client) - before
        ttft, rate = _speed_ratios(client, options, model, deployment.router_url, colocated_url)
    serving_s = time.perf_counter() - serving
    print(
        f"KV over NIXL: {moved.external_prompt_tokens:.0f} of {prompt_tokens} prompt tokens, "
        f"{moved.nixl_bytes:.0f} bytes, {moved.failed_transfers:.0f} failed transfers"
    )
    print(f"time to first token, router / colocated (median ratio): {ttft:.2f}")
    print(f"output tokens/s, router / colocated (median ratio):     {rate:.2f}")
    print(
        f"wall time: set-up {setup_s:.0f}s, engine start {engines_s:.0f}s, serving {serving_s:.0f}s"
    )
    # Each decode engine may compute a prompt's last token itself, nothing more.
    no_recompute = moved.external_prompt_tokens >= prompt_tokens - len(options.prompts)
    ok = all_match and no_recompute and moved.failed_transfers == 0
    verdict = "OK - every P/D answer equals the colocated answer and the KV came over NIXL"
    print("RESULT: " + (verdict if ok else "MISMATCH"))
    return 0 if ok else 1


def _compare_answers(
    client: httpx.Client, options: DemoOptions, model: str, router_url: str, colocated_url: str
) -> tuple[bool, int]:
    """Each prompt through the router and colocated, token ids compared and printed;
    (all equal, prompt tokens in all)."""
    all_match, prompt_tokens = True, 0
    for index, prompt in enumerate(options.prompts):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": options.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        pd = client.post(f"{router_url}/v1/completions", json=body)
        co = client.post(
            f"{colocated_url}/v1/completions", json={**body, "cache_salt": COLOCATED_SALT}
        )
        pd.raise_for_status()
        co.raise_for_status()
        pd_choice, co_choice = pd.json()["choices"][0], co.json()["choices"][0]
        match = pd_choice["token_ids"] == co_choice["token_ids"]
        prompt_tokens += pd.json()["usage"]["prompt_tokens"]
        all_match &= match
        print(
            f"prompt {index} ({pd.json()['usage']['prompt_tokens']} tokens): "
            f"{'MATCH' if match else 'DIFFERENT'}\n"
            f"  P/D:       {pd_choice['text']!r}\n  colocated: {co_choice['text']!r}"
        )
    return all_match, prompt_tokens


def _speed_ratios(
    client: httpx.Client, options: DemoOptions, model: str, router_url: str, colocated_url: str
) -> tuple[float, float]:
    """Median time to first token and output tokens/s, router over colocated, streamed
    alternately prompt by prompt."""
    timing: dict[str, list[tuple[float, float, int]]] = {"pd": [], "co": []}
    for prompt in options.prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": options.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        timing["pd"].append(stream_timing(client, router_url, body))
        timing["co"].append(
            stream_timing(client, colocated_url, {**body, "cache_salt": COLOCATED_SALT})
        )

    def median_ratio(index: int) -> float:
        pd = statistics.median(t[index] for t in timing["pd"])
        return pd / statistics.median(t[index] for t in timing["co"])

    return median_ratio(0), median_ratio(1)
