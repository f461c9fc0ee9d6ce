"""A batch or n > 1 split into one P/D request per prompt and choice, and merged back into
the response vLLM gives colocated (indices, usage, one stream)."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_hybrid_nixl.router.fanout import (
    EventSplitter,
    Part,
    fanout_size,
    merge_bodies,
    merged_events,
    split_request,
)
from vllm_hybrid_nixl.router.proxy import role_only, stream_error

pytestmark = pytest.mark.unit


def test_single_prompts_are_not_split() -> None:
    assert split_request("completions", {"prompt": "a"}) is None
    assert split_request("completions", {"prompt": [1, 2, 3]}) is None  # one token-id prompt
    assert split_request("completions", {"prompt": ["a"]}) is None
    assert split_request("chat", {"messages": [{"role": "user", "content": "x"}]}) is None


def test_a_batch_with_n_gets_vllms_choice_indices_and_seeds() -> None:
    parts = split_request("completions", {"prompt": ["a", "b"], "n": 2, "seed": 7})
    assert parts is not None
    assert [(p.index, p.body["prompt"], p.body["n"], p.body["seed"]) for p in parts] == [
        (0, "a", 1, 7),
        (1, "a", 1, 8),
        (2, "b", 1, 7),
        (3, "b", 1, 8),
    ]
    assert [p.first_choice for p in parts] == [True, False, True, False]
    assert fanout_size("completions", {"prompt": ["a", "b"], "n": 2}) == 4
    token_lists = split_request("completions", {"prompt": [[1, 2], [3]]})
    assert token_lists is not None and [p.body["prompt"] for p in token_lists] == [[1, 2], [3]]


def test_chat_n_splits_by_choice() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "n": 3}
    parts = split_request("chat", body)
    assert parts is not None and [p.index for p in parts] == [0, 1, 2]
    assert all(p.body["messages"] == body["messages"] and p.body["n"] == 1 for p in parts)


def answer(text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    return json.dumps(
        {
            "id": f"cmpl-{text}",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    ).encode()


def test_answers_merge_with_usage_counted_as_vllm_counts_it() -> None:
    parts = split_request("completions", {"prompt": ["a", "b"], "n": 2})
    assert parts is not None
    bodies = [answer("A0", 5, 3), answer("A1", 5, 3), answer("B0", 7, 3), answer("B1", 7, 3)]
    merged = json.loads(merge_bodies(parts, bodies))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "A0"),
        (1, "A1"),
        (2, "B0"),
        (3, "B1"),
    ]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24}


def test_events_split_whatever_the_chunk_boundaries() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: 1\n\ndata: ") == [b"data: 1"]
    assert splitter.feed(b"2\n") == []
    assert splitter.feed(b"\ndata: [DONE]\n\n") == [b"data: 2", b"data: [DONE]"]
    assert splitter.rest() == []


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_streams_merge_into_one_with_indices_one_usage_and_one_done() -> None:
    parts = [Part(0, True, {}), Part(1, True, {})]

    def stream(text: str, tokens: int) -> list[bytes]:
        chunk = {"id": f"id-{text}", "choices": [{"index": 0, "text": text}]}
        usage = {
            "id": f"id-{text}",
            "choices": [],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1},
        }
        whole = event(chunk) + event(usage) + b"data: [DONE]\n\n"
        return [whole[:7], whole[7:]]  # a boundary inside the first event

    chunks = [stream("a", 4), stream("b", 6)]

    def reader(i: int):
        async def read() -> bytes:
            await asyncio.sleep(0)
            return chunks[i].pop(0) if chunks[i] else b""

        return read

    async def collect() -> bytes:
        out = b""
        async for piece in merged_events(parts, [b"", b""], [reader(0), reader(1)]):
            out += piece
        return out

    merged = asyncio.run(collect())
    events = [e for e in merged.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and merged.count(b"[DONE]") == 1
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    texts = {c["index"]: c["text"] for p in payloads for c in p["choices"]}
    assert texts == {0: "a", 1: "b"}
    assert {p["id"] for p in payloads} == {payloads[0]["id"]}
    usage = [p["usage"] for p in payloads if p.get("usage")]
    assert usage == [{"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2}]


def test_a_chat_streams_role_chunk_is_read_past_to_the_error_after_it() -> None:
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    token = event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    error = event({"error": {"message": "Failed to load KV", "code": 500}})
    assert role_only(role) and not role_only(token) and not role_only(error)
    assert stream_error(role + error) == "Failed to load KV"
    assert stream_error(role + token) is None
