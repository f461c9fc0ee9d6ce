"""Requests the router can reject by itself, before any engine is touched.

Each check returns a :class:`RequestProblem` (status, OpenAI-style type, the parameter at
fault and what to change) or ``None``. What the router cannot judge alone (e.g. a prompt's
length in tokens of the model's tokenizer) is left to the engine, whose 4xx is passed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hybrid_nixl.router.fanout import fanout_size
from vllm_hybrid_nixl.router.settings import RouterSettings

ROUTER_OWNED = ("kv_transfer_params",)
#: vLLM samples greedily below this temperature (and then refuses n > 1).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class RequestProblem:
    status: int
    message: str
    param: str | None = None
    kind: str = "invalid_request_error"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_int(
    body: dict[str, Any], name: str, low: int, high: int, limit_name: str
) -> RequestProblem | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        return RequestProblem(400, f"{name} must be an integer, got {value!r}", name)
    if value < low:
        return RequestProblem(400, f"{name} must be at least {low}, got {value}", name)
    if value > high:
        return RequestProblem(
            400,
            f"{name} is {value}, more than this router allows ({high}, its {limit_name}); "
            f"ask for at most {high}",
            name,
        )
    return None


def _prompt_size(prompt: Any) -> tuple[int, int] | None:
    """(characters, token ids) of a completions prompt, or None when its type is wrong."""
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return 0, len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt), 0
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return 0, sum(len(p) for p in prompt)
    return None


def _message_chars(messages: Any) -> int | None:
    """Characters of text in chat messages, or None when they are not a list of messages."""
    if not isinstance(messages, list) or not messages:
        return None
    total = 0
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            return None
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict)]
            if not all(isinstance(text, str) for text in texts):
                return None  # a text part whose text is not a string
            total += sum(len(text) for text in texts)
    return total


def _prompt_problem(
    endpoint: str, body: dict[str, Any], settings: RouterSettings
) -> RequestProblem | None:
    if endpoint == "chat":
        chars = _message_chars(body.get("messages"))
        if chars is None:
            return RequestProblem(
                400,
                "messages must be a non-empty list of {role, content} objects whose text "
                "parts carry strings",
                "messages",
            )
        tokens, param = 0, "messages"
    else:
        if "prompt" not in body:
            return RequestProblem(400, "prompt is required", "prompt")
        size = _prompt_size(body["prompt"])
        if size is None:
            return RequestProblem(
                400,
                "prompt must be a non-empty string, list of strings, list of token ids or "
                "list of token-id lists",
                "prompt",
            )
        (chars, tokens), param = size, "prompt"
    if chars > settings.max_prompt_chars:
        return RequestProblem(
            413,
            f"{param} has {chars} characters, more than this router accepts "
            f"({settings.max_prompt_chars}, max_prompt_chars); shorten it",
            param,
        )
    if tokens > settings.max_prompt_tokens:
        return RequestProblem(
            413,
            f"{param} has {tokens} token ids, more than this router accepts "
            f"({settings.max_prompt_tokens}, max_prompt_tokens); shorten it",
            param,
        )
    return None


def request_problem(
    endpoint: str,
    body: Any,
    settings: RouterSettings,
    served_models: frozenset[str] = frozenset(),
    max_model_len: int | None = None,
) -> RequestProblem | None:
    """The first thing wrong with ``body`` for ``endpoint`` ("completions" or "chat")."""
    if not isinstance(body, dict):
        return RequestProblem(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return RequestProblem(400, f"model must be a string, got {model!r}", "model")
    if model is not None and served_models and model not in served_models:
        return RequestProblem(
            404,
            f"model {model!r} is not served here; available: {', '.join(sorted(served_models))}",
            "model",
            "model_not_found",
        )
    for name in ROUTER_OWNED:
        if name in body:
            return RequestProblem(
                400, f"{name} is set by the router and may not come from a client", name
            )
    if "stream" in body and not isinstance(body["stream"], bool | None):
        return RequestProblem(400, "stream must be true or false", "stream")
    if body.get("prompt_logprobs") is not None:
        return RequestProblem(
            400,
            "prompt_logprobs is not supported through prefill/decode disaggregation (the "
            "decode engine receives the prompt's KV cache, not its logits); send such requests "
            "to an engine directly",
            "prompt_logprobs",
        )
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        return RequestProblem(
            400, "best_of other than 1 is not supported through this router", "best_of"
        )
    if body.get("use_beam_search"):
        return RequestProblem(
            400,
            "beam search is not supported through prefill/decode disaggregation (vLLM's beam "
            "search hands no KV to a decode engine); send such requests to an engine directly",
            "use_beam_search",
        )
    token_limit = settings.max_tokens
    if max_model_len is not None:
        token_limit = min(token_limit, max_model_len)
    limit_name = "max_tokens setting" if token_limit == settings.max_tokens else "context length"
    for name in ("max_tokens", "max_completion_tokens"):
        problem = _bounded_int(body, name, 1, token_limit, limit_name)
        if problem:
            return problem
    problem = _bounded_int(body, "n", 1, settings.max_n, "max_n setting")
    if problem:
        return problem
    temperature = body.get("temperature")
    n = body.get("n") or 1
    greedy = isinstance(temperature, int | float) and temperature < GREEDY_BELOW
    if n > 1 and greedy:
        return RequestProblem(
            400,
            f"n must be 1 when using greedy sampling (temperature below {GREEDY_BELOW:g}), as "
            "vLLM requires; set a temperature above that or ask for one choice",
            "n",
        )
    if n > 1 and best_of is not None:
        return RequestProblem(
            400, f"best_of must be at least n ({n}), as vLLM requires; leave it out", "best_of"
        )
    problem = _prompt_problem(endpoint, body, settings)
    if problem:
        return problem
    parts = fanout_size(endpoint, body)
    if parts > settings.max_fanout:
        return RequestProblem(
            400,
            f"this request asks for {parts} answers (prompts x n), more than this router runs "
            f"for one request ({settings.max_fanout}, its max_fanout setting); split it",
            "prompt" if endpoint == "completions" else "n",
        )
    return None
