"""A completions batch (a prompt list) or ``n > 1`` as one P/D request per prompt and choice.

vLLM answers a prompt list or ``n > 1`` with one response whose choices are numbered
``prompt * n + choice``. Sent through P/D as one request, every choice after the first would
read the first prompt's prefill (vLLM's completions endpoint returns one prompt's
``kv_transfer_params`` for a batch, and ``n`` children share one prefill). So each prompt and
each choice gets its own prefill and decode legs here, and the answers are merged back into
the response vLLM would give colocated: the same choice indices, usage summed (prompt tokens
once per prompt, as vLLM counts them), one stream whose events carry their choice's index and
end with one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Part:
    """One prompt and choice of a fanned-out request."""

    index: int  # the choice index vLLM would give it
    first_choice: bool  # the first choice of its prompt (counts the prompt's tokens)
    body: dict[str, Any]


def _prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions batch; None for a single prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None  # one prompt as token ids
    return prompt if len(prompt) > 1 else None


def fanout_size(endpoint: str, body: dict[str, Any]) -> int:
    """How many P/D requests ``body`` becomes (prompts x n)."""
    prompts = _prompts(body) if endpoint == "completions" else None
    n = body.get("n") or 1
    return (len(prompts) if prompts else 1) * (n if isinstance(n, int) else 1)


def split_request(endpoint: str, body: dict[str, Any]) -> list[Part] | None:
    """The P/D requests that answer ``body``; None when it is one already."""
    prompts = _prompts(body) if endpoint == "completions" else None
    n = body.get("n") or 1
    if prompts is None and n == 1:
        return None
    prompts = prompts if prompts is not None else [body.get("prompt")]
    parts = []
    for p, prompt in enumerate(prompts):
        for choice in range(n):
            sub = {**body, "n": 1}
            seed = body.get("seed")
            if n > 1 and isinstance(seed, int) and not isinstance(seed, bool):
                sub["seed"] = seed + choice  # as vLLM seeds the children of n > 1
            if endpoint == "completions":
                sub["prompt"] = prompt
            parts.append(Part(p * n + choice, choice == 0, sub))
    return parts


def _usage_sum(usages: list[tuple[Part, dict[str, Any]]]) -> dict[str, int]:
    prompt = sum(int(u.get("prompt_tokens") or 0) for part, u in usages if part.first_choice)
    completion = sum(int(u.get("completion_tokens") or 0) for _, u in usages)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def merge_bodies(parts: list[Part], bodies: list[bytes]) -> bytes:
    """One response from the parts' non-streamed answers (in ``parts`` order)."""
    answers = [json.loads(b) for b in bodies]
    merged = dict(answers[0])
    choices = []
    for part, answer in zip(parts, answers, strict=True):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": part.index})
    merged["choices"] = choices
    usages = [(p, a["usage"]) for p, a in zip(parts, answers, strict=True) if a.get("usage")]
    if usages:
        merged["usage"] = _usage_sum(usages)
    return json.dumps(merged).encode()


class EventSplitter:
    """Server-sent events out of a stream's chunks, whatever their boundaries."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [e for e in events if e.strip()]

    def rest(self) -> list[bytes]:
        rest, self._buffer = self._buffer, b""
        return [rest] if rest.strip() else []


@dataclass
class StreamMerger:
    """Rewrites each part's events into the merged stream's: its choices' indices, one id
    for all; usage events are held back and summed into one after the last part ends."""

    parts: list[Part]
    stream_id: str | None = None

    def __post_init__(self) -> None:
        self._usages: list[tuple[Part, dict[str, Any]]] = []
        self._usage_template: dict[str, Any] | None = None

    def rewrite(self, part: Part, event: bytes) -> bytes | None:
        """The event as the merged stream sends it; None for events held back."""
        text = event.strip()
        if text == DONE or not text.startswith(b"data: "):
            return None if text == DONE else event + b"\n\n"
        try:
            payload = json.loads(text[6:])
        except ValueError:
            return event + b"\n\n"
        if not isinstance(payload, dict) or "error" in payload:
            return event + b"\n\n"
        if self.stream_id is None:
            self.stream_id = payload.get("id")
        if self.stream_id is not None:
            payload["id"] = self.stream_id
        choices = payload.get("choices") or []
        if payload.get("usage") and not choices:
            self._usages.append((part, payload["usage"]))
            self._usage_template = payload
            return None
        payload["choices"] = [{**c, "index": part.index} for c in choices]
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def closing(self) -> bytes:
        """The summed usage event (when the parts sent usage) and ``[DONE]``."""
        out = b""
        if self._usage_template is not None:
            usage = {**self._usage_template, "usage": _usage_sum(self._usages)}
            out += b"data: " + json.dumps(usage).encode() + b"\n\n"
        return out + DONE + b"\n\n"


async def merged_events(
    parts: list[Part],
    firsts: list[bytes],
    readers: list[Callable[[], Any]],
) -> Any:
    """Yield the merged stream's bytes as the parts' events arrive (interleaved)."""
    merger = StreamMerger(parts)
    queue: asyncio.Queue[tuple[int, bytes | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        splitter = EventSplitter()
        try:
            for event in splitter.feed(firsts[i]):
                await queue.put((i, event, None))
            while chunk := await readers[i]():
                for event in splitter.feed(chunk):
                    await queue.put((i, event, None))
            for event in splitter.rest():
                await queue.put((i, event, None))
            await queue.put((i, None, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(parts))]
    try:
        open_parts = len(parts)
        while open_parts:
            i, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                open_parts -= 1
                continue
            out = merger.rewrite(parts[i], event)
            if out:
                yield out
        yield merger.closing()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(BaseException):
                await task
