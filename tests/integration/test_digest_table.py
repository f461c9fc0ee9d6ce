"""A prefill worker's digest table stays bounded: a request's digests go soon after vLLM
reported its blocks sent, and the oldest go beyond the byte budget; the rest are served."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hybrid_nixl.connector import digest_guard
from vllm_hybrid_nixl.connector.digest_guard import DigestTable
from vllm_hybrid_nixl.protocol.digest_wire import GroupDigests

pytestmark = pytest.mark.integration


def digests(pages: int) -> dict[int, GroupDigests]:
    return {0: GroupDigests(np.arange(pages, dtype=np.int64), np.ones((pages, 2), np.uint64))}


def test_sent_requests_are_forgotten_after_the_grace(monkeypatch) -> None:
    monkeypatch.setattr(digest_guard, "AFTER_SENT_S", -1.0)  # already past
    table = DigestTable()
    table.put("a", digests(4))
    table.put("b", digests(4))
    table.sent(["a", "never-put"])
    table.put("c", digests(4))
    assert table.get("a") is None
    assert table.get("b") is not None and table.get("c") is not None


def test_the_oldest_go_beyond_the_byte_budget(monkeypatch) -> None:
    monkeypatch.setattr(digest_guard, "MAX_BYTES", 3 * 4 * 24)  # three 4-page entries
    table = DigestTable()
    for name in "abcd":
        table.put(name, digests(4))
    assert table.get("a") is None
    assert all(table.get(name) is not None for name in "bcd")
