"""What the router rejects by itself, case by case (pure function, no server)."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.router.settings import RouterSettings
from vllm_hybrid_nixl.router.validation import request_problem

pytestmark = pytest.mark.unit

SETTINGS = RouterSettings(max_prompt_chars=100, max_prompt_tokens=50, max_tokens=64, max_n=2)
MODELS = frozenset({"tiny"})


def problem(body, endpoint="completions", max_model_len=None):
    return request_problem(endpoint, body, SETTINGS, MODELS, max_model_len)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "hello", "max_tokens": 64},
        {"prompt": [1, 2, 3], "n": 2},
        {"prompt": ["ab", "cd"], "stream": True},
        {"prompt": [[1, 2], [3]], "max_tokens": None},
        {"prompt": "x" * 100, "best_of": 1},
    ],
)
def test_valid_completion_requests_pass(body) -> None:
    assert problem(body) is None


def test_valid_chat_request_passes_and_counts_text_parts() -> None:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert problem(chat, "chat") is None
    long_chat = {"messages": [{"role": "user", "content": "y" * 101}]}
    assert problem(long_chat, "chat").status == 413


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ([1, 2], 400, None, "JSON object"),
        ({"model": "other", "prompt": "p"}, 404, "model", "'other' is not served here"),
        ({"model": 3, "prompt": "p"}, 400, "model", "must be a string"),
        ({"prompt": "p", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"prompt": "p", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
        ({"prompt": "p", "max_tokens": 65}, 400, "max_tokens", "at most 64"),
        ({"prompt": "p", "max_tokens": "ten"}, 400, "max_tokens", "must be an integer"),
        ({"prompt": "p", "max_tokens": True}, 400, "max_tokens", "must be an integer"),
        ({"prompt": "p", "n": 3}, 400, "n", "max_n"),
        ({"prompt": "p", "n": 0}, 400, "n", "at least 1"),
        ({"prompt": "p", "best_of": 2}, 400, "best_of", "not supported"),
        ({"prompt": "p", "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
        ({"prompt": "p", "kv_transfer_params": {}}, 400, "kv_transfer_params", "router"),
        ({"prompt": "p", "stream": "yes"}, 400, "stream", "true or false"),
        ({}, 400, "prompt", "required"),
        ({"prompt": ""}, None, None, None),
        ({"prompt": []}, 400, "prompt", "non-empty"),
        ({"prompt": {"text": "p"}}, 400, "prompt", "non-empty string"),
        ({"prompt": "z" * 101}, 413, "prompt", "101 characters"),
        ({"prompt": list(range(51))}, 413, "prompt", "51 token ids"),
        ({"prompt": [[1] * 30, [2] * 30]}, 413, "prompt", "60 token ids"),
    ],
)
def test_bad_completion_requests_are_rejected_with_the_parameter(body, status, param, words):
    found = problem(body)
    if status is None:  # an empty string is the engine's to judge (some models accept it)
        assert found is None
        return
    assert found is not None, body
    assert (found.status, found.param) == (status, param)
    assert words in found.message


@pytest.mark.parametrize("messages", [None, [], "hi", [{"content": "no role"}], [["user", "hi"]]])
def test_bad_chat_messages_are_rejected(messages) -> None:
    found = problem({"messages": messages}, "chat")
    assert (found.status, found.param) == (400, "messages")


def test_max_tokens_is_bounded_by_the_context_length_when_known() -> None:
    found = problem({"prompt": "p", "max_tokens": 40}, max_model_len=32)
    assert found.status == 400 and "context length" in found.message
    assert problem({"prompt": "p", "max_completion_tokens": 32}, "completions", 32) is None


def test_unknown_model_passes_when_the_router_does_not_know_the_served_models() -> None:
    assert request_problem("completions", {"model": "x", "prompt": "p"}, SETTINGS) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2, "temperature": 1e-6}, "n"),  # vLLM samples greedily there
        ({"prompt": "x", "n": 2, "temperature": 0.7, "best_of": 1}, "best_of"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ],
)
def test_requests_vllm_refuses_colocated_are_refused_with_400(body, param) -> None:
    found = problem(body)
    assert found is not None and (found.status, found.param) == (400, param)


@pytest.mark.parametrize("text", [None, 5, ["a"]])
def test_chat_text_parts_that_are_not_strings_get_400_not_a_crash(text) -> None:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    found = problem(chat, "chat")
    assert found is not None and found.status == 400 and "strings" in found.message
