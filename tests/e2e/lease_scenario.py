"""The late-decode-leg scenario: prefill legs now, churn on the prefill engine, decode legs
later with the saved ``kv_transfer_params``; each decode answer classified."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.e2e.pd_fixture import PdPair
from vllm_hybrid_nixl.deploy.pd_client import prefill_body

PROMPTS = [
    f"Entry {i} of the lighthouse keeper's log: the fog came in from the west and " * 4
    for i in range(4)
]
CHURN = [f"Unrelated request number {i} about tides, ropes and lamps. " * 12 for i in range(40)]


@dataclass
class LateLegOutcome:
    correct: int = 0
    wrong_200: int = 0  # HTTP 200 with tokens other than the prompt's own answer
    errors: list[str] = field(default_factory=list)  # clear errors (status, text)

    @property
    def sent(self) -> int:
        return self.correct + self.wrong_200 + len(self.errors)

    def assert_guarded(self) -> None:
        """Zero 200-wrong; every leg a clear error, or (where vLLM cannot fail a hybrid load:
        releases before 0.32) correct after the decode engine computed the prompt itself."""
        from vllm_hybrid_nixl.connector import compat

        assert self.wrong_200 == 0, self
        assert self.sent == 4, self
        if compat.transfer_results_api():  # kv_load_failure_policy "fail" is honoured
            assert len(self.errors) == 4, self


def body(model: str, prompt: str, max_tokens: int = 12) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def expected_texts(engine_url: str, model: str) -> dict[str, str]:
    """Each prompt answered by one engine alone (greedy)."""
    with httpx.Client(timeout=120) as client:
        return {
            p: client.post(f"{engine_url}/v1/completions", json=body(model, p)).json()["choices"][
                0
            ]["text"]
            for p in PROMPTS
        }


def prefill_legs(prefill_url: str, model: str, prompts: list[str] | None = None) -> dict[str, dict]:
    """The prefill leg of every prompt; its ``kv_transfer_params`` by prompt."""
    saved = {}
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS if prompts is None else prompts:
            answer = client.post(
                f"{prefill_url}/v1/completions", json=prefill_body(body(model, prompt))
            )
            answer.raise_for_status()
            saved[prompt] = answer.json()["kv_transfer_params"]
    return saved


def churn(prefill_url: str, model: str) -> None:
    """Requests that reuse the prefill engine's freed blocks."""
    with httpx.Client(timeout=120) as client:
        for prompt in CHURN:
            client.post(f"{prefill_url}/v1/completions", json=body(model, prompt, 2))


def decode_legs(
    decode_url: str, model: str, saved: dict[str, dict], expected: dict[str, str]
) -> LateLegOutcome:
    outcome = LateLegOutcome()
    with httpx.Client(timeout=120) as client:
        for prompt, params in saved.items():
            answer = client.post(
                f"{decode_url}/v1/completions",
                json={**body(model, prompt), "kv_transfer_params": params},
            )
            if answer.status_code != 200:
                outcome.errors.append(f"{answer.status_code}: {answer.text[:300]}")
            elif answer.json()["choices"][0]["text"] == expected[prompt]:
                outcome.correct += 1
            else:
                outcome.wrong_200 += 1
    return outcome


def late_legs(
    pair: PdPair,
    expected: dict[str, str],
    wait_s: float,
    between: Callable[[], None] | None = None,
) -> LateLegOutcome:
    """Prefill legs, ``wait_s`` seconds, churn (or ``between``), then the decode legs."""
    saved = prefill_legs(pair.prefill.spec.url, pair.model)
    time.sleep(wait_s)
    (between or (lambda: churn(pair.prefill.spec.url, pair.model)))()
    return decode_legs(pair.decode.spec.url, pair.model, saved, expected)
