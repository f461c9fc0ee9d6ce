"""Pure parts of the router: the prefill leg's body and round-robin selection."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.router.app import prefill_body
from vllm_hybrid_nixl.router.backends import BackendPool

pytestmark = pytest.mark.unit


def test_prefill_leg_asks_for_one_token_kept_for_remote_decode() -> None:
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "stream": True,
        "n": 3,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "temperature": 0.5,
    }
    leg = prefill_body(body)
    assert leg == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "temperature": 0.5,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50  # the client's request is left as it was


def test_round_robin_visits_every_engine_in_turn() -> None:
    pool = BackendPool.from_urls(["http://p0/", "http://p1"], ["http://d0"])
    assert [pool.next_prefill().url for _ in range(5)] == [
        "http://p0",
        "http://p1",
        "http://p0",
        "http://p1",
        "http://p0",
    ]
    assert {pool.next_decode().name for _ in range(3)} == {"decode-0"}


def test_empty_role_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="no decode engine is configured"):
        BackendPool.from_urls(["http://p0"], []).next_decode()
