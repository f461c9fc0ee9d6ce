"""Corrupting KV in flight between real engines (``tests/harness/kv_corruption_site``) and
checking that the end-to-end KV digest catches every corruption: the router re-runs each
caught request and the client gets the colocated answer, never HTTP 200 with other tokens.

The engines of ``test_pd_pull`` (sliding window + full attention) and ``test_pd_mamba``
(Mamba2 + attention) run with the hook armed by a control file each; an idle hook changes
nothing, so the other tests of those modules run as before.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.e2e.pd_fixture import (
    PdPair,
    decode_errors,
    engine_errors,
    metric_sum,
    request_reruns,
)

HOOK_DIR = Path(__file__).resolve().parents[1] / "harness" / "kv_corruption_site"
CONTROL_VARIABLE = "VLLM_HYBRID_NIXL_TEST_CORRUPT"
ARMED_LINE = "vllm-hybrid-nixl test hook: KV corruption armed"
MISMATCH_LINE = "KV digest mismatch for request"
VERIFIED_LINE = "are verified byte for byte"


def hooked_env(control: Path) -> dict[str, str]:
    """An engine's environment with the corruption hook loaded and idle."""
    control.write_text(json.dumps({"where": "none", "left": 0}))
    path = [str(HOOK_DIR), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), CONTROL_VARIABLE: str(control)}


def control_of(pair: PdPair, side: str) -> Path:
    return Path(getattr(pair, side).spec.env[CONTROL_VARIABLE])


def arm(control: Path, where: str, kind: str, count: int) -> None:
    control.write_text(json.dumps({"where": where, "kind": kind, "left": count}))


def fired(control: Path) -> int:
    state = json.loads(control.read_text())
    return int(state.get("done", 0)) if int(state.get("left", 0)) == 0 else -1


METRIC = "vllm_hybrid_nixl_kv_digest_mismatches_total"


def mismatches(pair: PdPair) -> int:
    return pair.decode.log_text().count(MISMATCH_LINE)


def mismatch_lines(pair: PdPair) -> list[str]:
    return [line for line in pair.decode.log_text().splitlines() if MISMATCH_LINE in line]


def counted_mismatches(pair: PdPair, at_least: float, wait_s: float = 20.0) -> float:
    """The decode engine's mismatch counter once it reached ``at_least`` (vLLM hands worker
    stats to the API server with the next outputs), or its value after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        value = metric_sum(pair.decode.spec.url, METRIC)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def run_injected(
    pair: PdPair,
    router_url: str,
    bodies: list[dict],
    where: str,
    kind: str,
    same: Callable[[dict, dict], bool],
) -> None:
    """For each body, arm one corruption (the re-run is left clean) and send it through the
    router; require: every answer HTTP 200 and the same as the prefill engine alone, every
    corruption fired and reported as a digest mismatch, every caught request re-run, both
    engines up."""
    with httpx.Client(timeout=300) as client:
        alone = [
            client.post(f"{pair.prefill.spec.url}/v1/completions", json=body).json()["choices"][0]
            for body in bodies
        ]
        control = control_of(pair, "prefill" if where == "source" else "decode")
        caught_before, reruns_before = mismatches(pair), request_reruns(router_url)
        counted_before = metric_sum(pair.decode.spec.url, METRIC)
        wrong, missed = [], 0
        for body, expected in zip(bodies, alone, strict=True):
            arm(control, where, kind, 1)
            answer = client.post(f"{router_url}/v1/completions", json=body)
            if answer.status_code != 200:  # say why: the router's answer, both engines' errors
                raise AssertionError(
                    f"HTTP {answer.status_code}: {answer.text[:1500]}\n"
                    f"router health: {httpx.get(f'{router_url}/health', timeout=30).text}\n"
                    f"decode errors: {decode_errors(pair)}\n"
                    f"prefill errors: {engine_errors(pair.prefill, 5)}"
                )
            missed += fired(control) != 1
            choice = answer.json()["choices"][0]
            if not same(choice, expected):
                wrong.append((body["prompt"][:40], choice["text"], expected["text"]))
    assert missed == 0, f"the hook did not fire for {missed} of {len(bodies)} requests"
    assert not wrong, f"HTTP 200 with wrong tokens: {wrong}"
    assert mismatches(pair) - caught_before == len(bodies)
    for line in mismatch_lines(pair)[caught_before:]:  # what an operator needs, in each line
        assert f"({kind}), first at logical block " in line, line
        assert "(prefill request " in line and " on engine " in line, line
    counted = counted_mismatches(pair, counted_before + len(bodies)) - counted_before
    assert counted == len(bodies), f"{METRIC} rose by {counted}, {len(bodies)} caught"
    assert request_reruns(router_url) - reruns_before >= len(bodies)
    for engine in (pair.prefill, pair.decode):
        assert engine.alive()
        httpx.get(f"{engine.spec.url}/health", timeout=30).raise_for_status()


def run_uncaught_damage(
    pair: PdPair, bodies: list[dict], kind: str, same: Callable[[dict, dict], bool]
) -> list[bool]:
    """The negative control: damage received pages *after* the digest check passed (as if
    nothing checked), P/D straight to the engines; which answers still equal colocated."""
    from vllm_hybrid_nixl.deploy.pd_client import disaggregated_completion

    control = control_of(pair, "decode")
    results = []
    with httpx.Client(timeout=300) as client:
        alone = [
            client.post(f"{pair.prefill.spec.url}/v1/completions", json=body).json()["choices"][0]
            for body in bodies
        ]
        arm(control, "after-check", kind, len(bodies))
        for body, expected in zip(bodies, alone, strict=True):
            run = disaggregated_completion(
                client, pair.prefill.spec.url, pair.decode.spec.url, body
            )
            results.append(same(run.decode_response["choices"][0], expected))
    assert fired(control) == len(bodies)
    return results
