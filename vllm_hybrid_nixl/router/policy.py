"""Which engine of a role gets the next leg.

- ``least_in_flight`` (default): the engine with the fewest legs the router has in flight on
  it; ties go round-robin. A slow engine holds its legs longer and so gets fewer new ones.
- ``round_robin``: strict rotation, blind to load.
- ``prefix_affinity`` (prefill only): the same prompt prefix goes to the same engine
  (rendezvous hashing over the usable engines, so an engine leaving moves only its own
  prefixes), for prefix-cache hits; when that engine has ``AFFINITY_SLACK`` more legs in
  flight than the least loaded one, the leg goes to the least loaded one instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from vllm_hybrid_nixl.router.backends import Backend

PolicyName = Literal["least_in_flight", "round_robin", "prefix_affinity"]
POLICIES: tuple[str, ...] = ("least_in_flight", "round_robin", "prefix_affinity")
AFFINITY_SLACK = 4  # legs in flight beyond the least loaded engine that affinity tolerates
PREFIX_CHARS = 256  # how much of a text prompt makes its affinity key
PREFIX_TOKENS = 64  # ... of a token-id prompt
BYTES_PER_TOKEN = 4  # UTF-8 bytes a token, estimated (English text in common BPE vocabularies)


def prefix_key(body: dict[str, Any]) -> bytes | None:
    """The affinity key of a completions or chat body: the start of its prompt."""
    prompt: Any = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = json.dumps(body["messages"], sort_keys=True)[:PREFIX_CHARS]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):  # JSON may carry lone surrogates: keep them, never raise
        return prompt[:PREFIX_CHARS].encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:PREFIX_TOKENS]):
        return json.dumps(prompt[:PREFIX_TOKENS]).encode()
    return None


def _rendezvous(key: bytes, backend: Backend) -> bytes:
    return hashlib.blake2b(key + b"\0" + backend.url.encode(), digest_size=8).digest()


def choose(
    candidates: Sequence[Backend],
    policy: PolicyName,
    in_flight: Callable[[Backend], int],
    key: bytes | None = None,
) -> tuple[Backend, str]:
    """The engine for the next leg among ``candidates`` (usable, in rotation order, at least
    one) and why: ``only_choice`` (one candidate), ``round_robin``, ``least_in_flight``,
    ``affinity`` or ``affinity_overloaded``."""
    if len(candidates) == 1:
        return candidates[0], "only_choice"
    if policy == "round_robin":
        return candidates[0], "round_robin"
    loads = {b.url: in_flight(b) for b in candidates}
    least = min(candidates, key=lambda b: loads[b.url])  # first of the least loaded: rotation
    if policy == "prefix_affinity" and key is not None:
        home = max(candidates, key=lambda b: _rendezvous(key, b))
        if loads[home.url] - loads[least.url] < AFFINITY_SLACK:
            return home, "affinity"
        return least, "affinity_overloaded"
    return least, "least_in_flight"


def _estimate(text: str) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


def prompt_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """A request's prompt length in tokens, from the field its endpoint reads (``messages``
    for chat, ``prompt`` otherwise): counted for a token-id prompt, estimated from UTF-8
    bytes (``BYTES_PER_TOKEN``) for text. None where it cannot be told from the body (a
    batch, prompt embeddings, tools, non-text message parts): such a request goes P/D."""
    if "prompt_embeds" in body or body.get("tools"):
        return None
    if not chat:
        prompt: Any = body.get("prompt")
        if isinstance(prompt, str):
            return _estimate(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return len(prompt)
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += _estimate(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type", "text") != "text":
                    return None  # an image, audio or file part: its tokens are unknown here
                text = part.get("text")
                if not isinstance(text, str):
                    return None
                total += _estimate(text)
        elif content is not None:
            return None
    return total
