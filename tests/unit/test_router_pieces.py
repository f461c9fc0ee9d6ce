"""Pure parts of the router: the prefill leg's body and round-robin selection."""

from __future__ import annotations

import pytest

from vllm_hybrid_nixl.router.backends import BackendPool, NoCompatiblePairError
from vllm_hybrid_nixl.router.proxy import prefill_body

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
    pool = BackendPool.from_urls(["http://p0/", "http://p1"], ["http://d0", "http://d1"])
    pairs = [pool.next_pair(lambda p, d: "") for _ in range(4)]
    assert [(p.url, d.url) for p, d in pairs] == [
        ("http://p0", "http://d0"),
        ("http://p1", "http://d1"),
        ("http://p0", "http://d0"),
        ("http://p1", "http://d1"),
    ]


def test_refused_pairs_are_skipped_and_all_refused_names_the_reasons() -> None:
    pool = BackendPool.from_urls(["http://p0", "http://p1"], ["http://d0"])

    def only_p1(p, d) -> str:
        return "" if p.url == "http://p1" else f"{p.label} and {d.label}: block_size differs"

    assert {pool.next_pair(only_p1)[0].url for _ in range(3)} == {"http://p1"}
    with pytest.raises(NoCompatiblePairError) as caught:
        pool.next_pair(lambda p, d: f"{p.label}/{d.label} refused")
    assert caught.value.reasons == ["prefill-0/decode-0 refused", "prefill-1/decode-0 refused"]


def test_empty_role_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="no decode engine is configured"):
        BackendPool.from_urls(["http://p0"], []).next_pair(lambda p, d: "")


def test_side_channels_follow_the_urls_and_a_count_mismatch_is_explained() -> None:
    pool = BackendPool.from_urls(["http://p0"], ["http://d0"], ["127.0.0.1:5600"], None)
    assert pool.prefill[0].side_channel == "127.0.0.1:5600"
    assert pool.decode[0].side_channel == ""
    with pytest.raises(ValueError, match="1 decode URL\\(s\\) but 2 decode side channel"):
        BackendPool.from_urls(["http://p0"], ["http://d0"], None, ["a:1", "b:2"])


def test_an_error_as_first_stream_event_is_recognised() -> None:
    from vllm_hybrid_nixl.router.proxy import stream_error

    vllm_error = b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
    assert stream_error(vllm_error) == "Internal server error"
    token = b'data: {"id": "cmpl-1", "choices": [{"text": " the"}]}\n\n'
    assert stream_error(token) is None
    assert stream_error(b"data: [DONE]\n\n") is None
    assert stream_error(b"") is None


@pytest.mark.parametrize(("given", "sent"), [(3, 1), (1, 1), (0, 0), ("x", "x"), (True, True)])
def test_min_tokens_is_clamped_to_the_prefill_legs_one_token(given, sent) -> None:
    """Only integers above 1 are clamped; anything else is left for the engine to judge."""
    assert prefill_body({"prompt": "p", "min_tokens": given})["min_tokens"] == sent


def test_json_depth_is_counted_without_recursion() -> None:
    from vllm_hybrid_nixl.router.limits import json_depth

    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_depth(deep, 64) == 65  # stops counting past the limit
    assert json_depth({"a": [{"b": 1}]}, 64) == 3
    assert json_depth("scalar", 64) == 0


def test_leg_errors_for_clients_name_engines_not_addresses() -> None:
    from vllm_hybrid_nixl.router.proxy import LegError, NoEngineError

    pool = BackendPool.from_urls(["http://10.1.2.3:8100"], ["http://10.1.2.4:8200"])
    judged = LegError(
        "prefill",
        pool.prefill[0],
        400,
        "HTTP 400: bad",
        "client_error",
        upstream={
            "message": "temperature must be >= 0",
            "type": "BadRequestError",
            "param": "temperature",
        },
    )
    assert judged.public_message == "temperature must be >= 0"
    failed = LegError("decode", pool.decode[0], 502, "HTTP 500: boom", "engine_error")
    assert failed.public_message == "decode leg failed on engine decode-0: HTTP 500: boom"
    assert "10.1.2.4" in failed.message  # the log keeps the address
    nothing = NoEngineError("prefill", [judged], [])
    assert "10.1.2.3" in str(nothing) and "10.1.2.3" not in nothing.public_message
