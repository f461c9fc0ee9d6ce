"""The routing policies: which engine of a role gets the next leg."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid_nixl.router.backends import Backend, BackendPool
from vllm_hybrid_nixl.router.policy import AFFINITY_SLACK, choose, prefix_key

pytestmark = pytest.mark.unit

ENGINES = [Backend(f"http://127.0.0.1:{9000 + i}", "prefill", f"prefill-{i}") for i in range(3)]


def loads(**by_name: int):
    return lambda backend: by_name.get(backend.name.replace("-", "_"), 0)


def test_least_in_flight_takes_the_least_loaded_engine() -> None:
    engine, reason = choose(
        ENGINES, "least_in_flight", loads(prefill_0=3, prefill_1=1, prefill_2=2)
    )
    assert (engine.name, reason) == ("prefill-1", "least_in_flight")


def test_least_in_flight_breaks_ties_in_rotation_order() -> None:
    pool = BackendPool(list(ENGINES), [])
    idle = loads()

    def least(candidates):
        return choose(candidates, "least_in_flight", idle)[0]

    picked = [pool.pick("prefill", lambda b: True, choose=least).name for _ in range(6)]
    assert picked == ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_one_candidate_is_the_only_choice() -> None:
    for policy in ("least_in_flight", "round_robin", "prefix_affinity"):
        assert choose(ENGINES[1:2], policy, loads(), b"k") == (ENGINES[1], "only_choice")


def test_round_robin_ignores_load() -> None:
    engine, reason = choose(ENGINES, "round_robin", loads(prefill_0=50))
    assert (engine.name, reason) == ("prefill-0", "round_robin")


def test_prefix_affinity_sends_a_prefix_to_the_same_engine_whatever_the_rotation() -> None:
    key = prefix_key({"prompt": "the same system prompt " * 20 + "question one"})
    homes = {
        choose(ENGINES[i:] + ENGINES[:i], "prefix_affinity", loads(), key)[0] for i in range(3)
    }
    assert len(homes) == 1
    # a different ending past the key's length keeps the home: only the prefix counts
    other = prefix_key({"prompt": "the same system prompt " * 20 + "question two"})
    assert choose(ENGINES, "prefix_affinity", loads(), other)[0] in homes


def test_prefix_affinity_spreads_different_prefixes() -> None:
    homes = {
        choose(ENGINES, "prefix_affinity", loads(), prefix_key({"prompt": f"user {i} says"}))[0]
        for i in range(60)
    }
    assert homes == set(ENGINES)


def test_prefix_affinity_yields_to_load_past_the_slack() -> None:
    key = prefix_key({"prompt": "hello"})
    home, reason = choose(ENGINES, "prefix_affinity", loads(), key)
    assert reason == "affinity"
    busy = {home.name.replace("-", "_"): AFFINITY_SLACK}
    engine, reason = choose(ENGINES, "prefix_affinity", loads(**busy), key)
    assert engine != home and reason == "affinity_overloaded"
    nearly = {home.name.replace("-", "_"): AFFINITY_SLACK - 1}
    assert choose(ENGINES, "prefix_affinity", loads(**nearly), key) == (home, "affinity")


def test_an_engine_leaving_moves_only_its_own_prefixes() -> None:
    keys = [prefix_key({"prompt": f"tenant {i}"}) for i in range(60)]
    before = {k: choose(ENGINES, "prefix_affinity", loads(), k)[0] for k in keys}
    after = {k: choose(ENGINES[:2], "prefix_affinity", loads(), k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == ENGINES[2] for k in moved)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"prompt": "x" * 1000}, b"x" * 256),
        ({"prompt": ["first", "second"]}, b"first"),
        ({"prompt": list(range(100))}, json.dumps(list(range(64))).encode()),
        ({"messages": [{"role": "user", "content": "hi"}]}, None),
        ({"prompt": 5}, None),
    ],
    ids=["text", "batch", "token-ids", "chat", "odd"],
)
def test_prefix_key_is_the_start_of_the_prompt(body: dict, key: bytes | None) -> None:
    if "messages" in body:
        assert prefix_key(body) is not None and b"hi" in prefix_key(body)
    else:
        assert prefix_key(body) == key


def test_a_prompt_with_a_lone_surrogate_still_has_an_affinity_key() -> None:
    body = json.loads('{"prompt": "ab\\ud800c"}')
    key = prefix_key(body)
    assert key is not None and key != prefix_key({"prompt": "abc"})
