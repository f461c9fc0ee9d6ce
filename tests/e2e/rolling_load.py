"""Clients that keep requests running through a router while engines restart, and the
answers they must get (one engine's alone, token for token): shared by the rolling-restart
tests of plain engines (``test_drain``) and of containers (``test_containers``).

One allowance, with evidence: under many clients the engines batch requests, and a batch sums
in another order than a request alone, so logprobs move by a few thousandths of a nat. A
random-weight model has near-uniform logits, so once in a while its two best candidates are
closer than that and greedy picks the other one (seen in CI under 32 clients: one prompt's
24th token, 182 instead of 91, the 23 before equal). An answer that first leaves the
expected one at a token where the engine alone had its top two within ``NEAR_TIE`` is
counted as right (and counted as a near tie); any other difference is a wrong answer."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters

CLIENTS = 8  # in flight at every stop (drains have work); more only slows restarts
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 180.0  # a request still unanswered after this counts as hung
FILLER = "the kv cache moves between engines "
PROMPTS = [f"rolling restart {i}: " + FILLER * 4 * i for i in range(8)]
NEAR_TIE = 0.03  # nats between the alone run's top two candidates (as tests/e2e/mamba_answers)


class AloneAnswers(dict[str, list[int]]):
    """Each prompt's token ids from one engine alone, and at each token the nats between that
    engine's two best candidates (``gaps[prompt][i]``)."""

    gaps: dict[str, list[float]]

    def near_tie_at(self, prompt: str, tokens: list[int]) -> int | None:
        """The token where ``tokens`` first leaves this prompt's answer, if that token was a
        near tie for the engine alone (and the lengths agree); else None."""
        expected = self[prompt]
        if len(tokens) != len(expected):
            return None
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        gaps = getattr(self, "gaps", {}).get(prompt) or []
        return first if first < len(gaps) and gaps[first] < NEAR_TIE else None


@dataclass
class Load:
    """Clients sending requests through the router until stopped; outcomes by kind."""

    router_url: str
    model: str
    expected: AloneAnswers
    headers: dict[str, str] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, client_index: int) -> None:
        turns = itertools.count(client_index)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, headers=self.headers) as client:
            while not self.stop.is_set():
                turn = next(turns)
                prompt = PROMPTS[turn % len(PROMPTS)]
                self.record(*self.one(client, prompt, stream=turn % 2 == 0))

    def one(self, client: httpx.Client, prompt: str, stream: bool) -> tuple[str, str]:
        body = request_body(self.model, prompt)
        body["stream"] = stream
        expected = self.expected[prompt]
        url = f"{self.router_url}/v1/completions"
        tokens: list[int] = []
        try:
            if stream:
                with client.stream("POST", url, json=body) as answer:
                    if answer.status_code != 200:
                        return (
                            "failed",
                            f"stream HTTP {answer.status_code}: {answer.read()[:300]!r}",
                        )
                    for line in answer.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                return "failed", f"error event {event['error']}"
                            tokens += event["choices"][0].get("token_ids") or []
            else:
                answer = client.post(url, json=body)
                if answer.status_code != 200:
                    return "failed", f"HTTP {answer.status_code}: {answer.text[:300]}"
                tokens = answer.json()["choices"][0]["token_ids"]
        except httpx.TimeoutException as exc:
            return "hung", f"no answer in {REQUEST_TIMEOUT_S:g} s: {exc!r}"
        except httpx.HTTPError as exc:
            return "failed", repr(exc)
        if tokens != expected:
            at = self.expected.near_tie_at(prompt, tokens)
            detail = f"{prompt[:30]!r} (stream {stream}): {tokens} != {expected}"
            return ("near_tie", f"at token {at}: {detail}") if at is not None else ("wrong", detail)
        return "ok", ""

    def record(self, kind: str, problem: str) -> None:
        with self.lock:
            self.outcomes[kind] += 1
            if kind == "near_tie":  # a right answer (module docstring), kept for the log
                self.outcomes["ok"] += 1
                self.near_ties.append(problem)
            elif problem:
                self.problems.append(f"{kind}: {problem}")

    def answered(self) -> int:
        with self.lock:
            return self.outcomes["ok"]

    def wait_answers(self, more: int, timeout_s: float = 300.0) -> None:
        """Until ``more`` further right answers came; fails at the first problem."""
        target, deadline = self.answered() + more, time.monotonic() + timeout_s
        while self.answered() < target:
            with self.lock:
                assert not self.problems, self.problems[:5]
            assert time.monotonic() < deadline, f"no {more} answers in {timeout_s} s"
            time.sleep(0.2)


def wait_for_pd(load: Load, decode_url: str, clients: int, rounds: int = 4) -> float:
    """Bytes the decode engine at ``decode_url`` read over NIXL while ``load`` got up to
    ``rounds`` x ``clients`` more right answers, stopping at the first round in which it read
    some. After an engine came back, the first answers can all be requests the router had
    already run colocated (one per client in flight), so one round proves nothing."""
    moved = 0.0
    for _ in range(rounds):
        before = read_kv_transfer_counters(decode_url)
        load.wait_answers(clients)
        moved = (read_kv_transfer_counters(decode_url) - before).nixl_bytes
        if moved > 0:
            break
    return moved


def request_body(model: str, prompt: str) -> dict:
    """Greedy, a fixed length, token ids in the answer (random weights: compare ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body.update(ignore_eos=True, return_token_ids=True)
    return body


def alone(engine_url: str, model: str, headers: dict[str, str] | None = None) -> AloneAnswers:
    """Each prompt's token ids from one engine alone, with its top-two gaps per token."""
    answers = AloneAnswers()
    answers.gaps = {}
    with httpx.Client(timeout=300.0, headers=headers or {}) as client:
        for prompt in PROMPTS:
            body = {**request_body(model, prompt), "logprobs": 2}
            choice = client.post(f"{engine_url}/v1/completions", json=body).json()["choices"][0]
            answers[prompt] = choice["token_ids"]
            answers.gaps[prompt] = [_top_two_gap(top) for top in choice["logprobs"]["top_logprobs"]]
    return answers


def _top_two_gap(top: dict[str, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")
