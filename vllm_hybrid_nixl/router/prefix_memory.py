"""Which decode engine holds how much of a prompt's start in its prefix cache, as far as the
router can tell from the prompts it sent there.

A prompt is cut into chunks (``CHUNK_TOKENS`` token ids, or ``CHUNK_TOKENS`` x
``BYTES_PER_TOKEN`` UTF-8 bytes of text; a chat body's messages as canonical JSON), each
chunk keyed by a hash chained over the chunks before it, so a key stands for the whole
prefix up to its chunk. The memory is a bounded LRU of (engine, key): old prefixes leave it
as the engine's own cache would evict them. It is an estimate: an engine may have evicted a
prefix the router remembers (the request then prefills more on the decode engine than
expected, and is still answered right), and an engine restarted under the same URL is
forgotten when the router sees it come back up.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hybrid_nixl.router.policy import BYTES_PER_TOKEN

CHUNK_TOKENS = 64  # tokens a chunk stands for (a multiple of the usual KV block sizes)
DEFAULT_CAPACITY = 200_000  # (engine, chunk) entries kept: ~13M prompt tokens, ~30 MB


@dataclass(frozen=True)
class PromptChunks:
    """A prompt's chained chunk keys, the tokens each full chunk stands for, and how many of
    the prompt's units (bytes or token ids) each chunk and the whole prompt hold."""

    keys: tuple[bytes, ...]
    tokens_per_chunk: int
    units_per_chunk: int
    total_units: int

    def cached_share(self, cached_tokens: int) -> float:
        """The share of the whole prompt that ``cached_tokens`` (as :class:`PrefixMemory`
        counts them) covers: a chat chunk's bytes include JSON keys and escapes, so shares,
        not byte estimates, compare with the prompt's own length estimate."""
        chunks = cached_tokens // self.tokens_per_chunk
        return min(1.0, chunks * self.units_per_chunk / max(1, self.total_units))


def prompt_chunks(body: dict[str, Any], chat: bool) -> PromptChunks | None:
    """The chunk keys of the prompt the endpoint reads (``messages`` for chat, ``prompt``
    otherwise); None for a batch, prompt embeddings, a prompt vLLM truncates from the left
    (``truncate_prompt_tokens``) or anything else not one prompt. The chain starts from the
    model and ``cache_salt``, which change vLLM's own block hashes (a LoRA, a tenant)."""
    if "prompt_embeds" in body or body.get("truncate_prompt_tokens") is not None:
        return None
    seed = hashlib.blake2b(
        json.dumps([body.get("model"), body.get("cache_salt")], default=str).encode(
            "utf-8", "surrogatepass"
        ),
        digest_size=16,
    ).digest()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        # One message after another, each as canonical JSON: a conversation that grows by a
        # turn keeps the bytes, and so the keys, of every turn before it.
        units: bytes | list[int] = b"".join(
            json.dumps(m, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
            for m in messages
        )
        return _chunked(seed, units, CHUNK_TOKENS * BYTES_PER_TOKEN, CHUNK_TOKENS)
    prompt: Any = body.get("prompt")
    if isinstance(prompt, str):
        text = prompt.encode("utf-8", "surrogatepass")
        return _chunked(seed, text, CHUNK_TOKENS * BYTES_PER_TOKEN, CHUNK_TOKENS)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return _chunked(seed, prompt, CHUNK_TOKENS, CHUNK_TOKENS)
    return None


def _chunked(
    seed: bytes, units: bytes | list[int], units_per_chunk: int, tokens: int
) -> PromptChunks:
    keys = []
    previous = seed
    for start in range(0, len(units) - units_per_chunk + 1, units_per_chunk):
        piece = units[start : start + units_per_chunk]
        data = piece if isinstance(piece, bytes) else json.dumps(piece).encode()
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        keys.append(previous)
    return PromptChunks(tuple(keys), tokens, units_per_chunk, len(units))


class PrefixMemory:
    """The prompt prefixes the router sent to each decode engine, newest kept."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix memory needs room for at least one chunk, not {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._per_engine: Counter[str] = Counter()
        self._caching: set[str] = set()

    def engine_up(self, engine_url: str, caches_prefixes: bool) -> None:
        """``engine_url`` (re)started: what it held is gone; only an engine whose prefix
        caching is on (``vllm:cache_config_info``) is remembered and routed to by prefix."""
        self.forget([engine_url])
        if caches_prefixes:
            self._caching.add(engine_url)
        else:
            self._caching.discard(engine_url)

    def caches_prefixes(self, engine_url: str) -> bool:
        return engine_url in self._caching

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, engine_url: str, chunks: PromptChunks) -> None:
        """``engine_url`` now holds every chunk of ``chunks`` (it served the prompt); nothing
        for an engine not known to cache prefixes."""
        if engine_url not in self._caching:
            return
        # The last chunk first: the prompt's start is the newest, so eviction takes its
        # tail first, as the engine's own cache does (a chained key without its start is
        # useless).
        for key in reversed(chunks.keys):
            entry = (engine_url, key)
            if entry in self._entries:
                self._entries.move_to_end(entry)
            else:
                self._entries[entry] = None
                self._per_engine[engine_url] += 1
        while len(self._entries) > self.capacity:
            (url, _), _ = self._entries.popitem(last=False)
            self._per_engine[url] -= 1

    def cached_tokens(self, engine_url: str, chunks: PromptChunks) -> int:
        """Tokens of the prompt's start that ``engine_url`` is thought to hold."""
        matched = 0
        for key in chunks.keys:  # chained keys: the first miss ends the prefix
            if (engine_url, key) not in self._entries:
                break
            matched += 1
        return matched * chunks.tokens_per_chunk

    def best_engine(
        self, engine_urls: Sequence[str], chunks: PromptChunks
    ) -> tuple[str | None, int]:
        """The engine among ``engine_urls`` holding the longest start of the prompt and how
        many tokens it holds; (None, 0) when none holds a chunk of it."""
        best, best_tokens = None, 0
        for url in engine_urls:
            tokens = self.cached_tokens(url, chunks)
            if tokens > best_tokens:
                best, best_tokens = url, tokens
        return best, best_tokens

    def forget(self, engine_urls: Iterable[str]) -> None:
        """Drop what ``engine_urls`` held (restarted engines start with an empty cache)."""
        gone = {url for url in engine_urls if self._per_engine.get(url, 0) > 0}
        if not gone:
            return
        for entry in [e for e in self._entries if e[0] in gone]:
            del self._entries[entry]
        for url in gone:
            del self._per_engine[url]
