"""The layout fingerprint: wire form, comparison and the messages users read."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import zlib

import pytest

from vllm_hybrid_nixl.protocol.fingerprint import (
    GroupFingerprint,
    LayoutFingerprint,
    compare_with_peer,
    decode,
    differences,
    mismatch_message,
    stock_peer_message,
)

pytestmark = pytest.mark.unit


def make(block_size: int = 64, groups: int = 2, **overrides) -> LayoutFingerprint:
    kinds = ["sliding_window", "full_attention", "sliding_window", "full_attention"]
    base = LayoutFingerprint(
        vllm_version="0.32.0",
        transfer_mode="pull",
        model="/models/tiny",
        dtype="float32",
        cache_dtype="auto",
        num_hidden_layers=4,
        num_kv_heads=2,
        head_size=32,
        tensor_parallel_size=1,
        kv_layout="NHD",
        attn_backend="CPU_ATTN",
        hybrid_kv_cache_manager=True,
        groups=tuple(
            GroupFingerprint(
                kind=kinds[i],
                num_layers=2,
                block_size=block_size,
                kernel_block_size=block_size,
                ratio=1,
                page_bytes=2 * 2 * 32 * 4 * block_size,
                sliding_window=64 if kinds[i] == "sliding_window" else None,
                dtype="float32",
            )
            for i in range(groups)
        ),
        vllm_compat_hash="ab" * 32,
    )
    return dataclasses.replace(base, **overrides)


def test_wire_form_round_trips_and_equal_layouts_give_equal_strings() -> None:
    wire = make().encode()
    assert wire.startswith("hybrid-nixl/1:")
    assert decode(wire) == make()
    assert make().encode() == wire  # vLLM's own string comparison must keep passing
    assert make(block_size=32).encode() != wire


def test_tampered_wire_string_is_rejected() -> None:
    prefix, digest, packed = make().encode().split(":", 2)
    other = make(block_size=32).encode().split(":", 2)[2]
    with pytest.raises(ValueError, match="digest"):
        decode(f"{prefix}:{digest}:{other}")
    with pytest.raises(ValueError, match="not a vllm-hybrid-nixl"):
        decode("hybrid-nixl/1:zz:not-base64!")
    # a consistent digest over a field of the wrong type ("2" for 2) is refused too, so no
    # comparison downstream (router, check, worker) meets a string where it does arithmetic
    data = dataclasses.asdict(make())
    data["tensor_parallel_size"] = "2"
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    packed = base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()
    digest = hashlib.sha256(text.encode()).hexdigest()
    with pytest.raises(ValueError, match="not a vllm-hybrid-nixl"):
        decode(f"hybrid-nixl/1:{digest}:{packed}")


def test_block_size_mismatch_names_every_group_field_with_both_values() -> None:
    found = differences(make(block_size=32), make(block_size=64))
    names = {item.field for item in found}
    assert "groups[0].block_size" in names and "groups[1].block_size" in names
    assert "groups[0].page_bytes" in names
    assert "vllm_compat_hash" not in names  # only named when it is the sole difference
    message = mismatch_message(found, "decode", "prefill", "engine-p (127.0.0.1:5600)")
    assert "groups[0].block_size: decode (this engine) 32, prefill 64" in message
    assert "--block-size" in message and "engine-p (127.0.0.1:5600)" in message


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("model", "/models/other", "same model"),
        ("dtype", "bfloat16", "--dtype"),
        ("num_hidden_layers", 6, "same model"),
        ("transfer_mode", "push", "HybridNixlPushConnector"),
        ("vllm_version", "0.31.0", "same vLLM release"),
    ],
)
def test_each_model_level_difference_is_named(field: str, value, hint: str) -> None:
    found = differences(make(), make(**{field: value}))
    assert [item.field for item in found] == [field]
    assert hint in mismatch_message(found, "decode", "prefill", "p")


def test_vllm_hash_alone_is_named_when_nothing_readable_differs() -> None:
    found = differences(make(), make(vllm_compat_hash="cd" * 32))
    assert [item.field for item in found] == ["vllm_compat_hash"]


def mamba_hybrid(tp: int, n_groups: int = 2, **overrides) -> LayoutFingerprint:
    """A tiny NemotronH-style fingerprint at TP ``tp``: one attention group (2 KV heads) and
    one Mamba2 group whose per-rank conv rows are (x + 2 * padded groups * 16) / tp, with
    vLLM's padding of B/C groups to the TP size when n_groups does not divide it."""
    padded = n_groups if n_groups % tp == 0 else n_groups + (tp - n_groups % tp)
    conv_rows = (256 + 2 * padded * 16) // tp
    page = 2 * 2 * 32 * 4 * 64 // tp
    state = f"mamba2 (3,{conv_rows})+({8 // tp},32,16) float32+float32"
    attention = GroupFingerprint("full_attention", 2, 64, 64, 1, page, None, "float32")
    mamba = GroupFingerprint("mamba", 2, 64, 64, 1, page, None, "float32", state=state)
    return dataclasses.replace(
        make(tensor_parallel_size=tp, **overrides), groups=(attention, mamba)
    )


def test_tensor_parallel_sizes_are_judged_by_the_per_rank_splits() -> None:
    """Plain models: TP is not part of the layout. Hybrid models: different TP sizes pass when
    every rank holds an exact slice of the same layout; a replicated Mamba state, sizes that do
    not divide, push mode, a prefill replicating KV heads into a smaller decode TP, and pages
    that are not the head split are named with what to change."""
    assert differences(make(groups=1), make(groups=1, tensor_parallel_size=2)) == []
    assert differences(mamba_hybrid(2), mamba_hybrid(1)) == []  # n_groups 2 splits over TP 2
    assert differences(mamba_hybrid(1), mamba_hybrid(2), "prefill") == []  # and the other way
    sliding = make(groups=2)  # 2 KV heads: TP 2 holds one per rank
    halved = [dataclasses.replace(g, page_bytes=g.page_bytes // 2) for g in sliding.groups]
    assert (
        differences(
            dataclasses.replace(make(tensor_parallel_size=2), groups=tuple(halved)), sliding
        )
        == []
    )

    found = differences(mamba_hybrid(2, n_groups=1), mamba_hybrid(1, n_groups=1))
    assert [item.field for item in found] == ["groups[1].state"]
    message = mismatch_message(found, "decode", "prefill", "p")
    assert "n_groups is not divisible by TP" in message and "(3,160)" in message

    found = differences(make(tensor_parallel_size=2), sliding)
    assert [item.field for item in found] == ["groups[0].page_bytes", "groups[1].page_bytes"]
    assert "2 KV heads split over TP 2 and 1" in mismatch_message(found, "d", "p", "p")

    found = differences(mamba_hybrid(2), mamba_hybrid(3))
    assert [item.field for item in found] == ["tensor_parallel_size"]
    assert "divide each other" in mismatch_message(found, "d", "p", "p")

    pushed = differences(
        mamba_hybrid(2, transfer_mode="push"), mamba_hybrid(1, transfer_mode="push")
    )
    assert [item.field for item in pushed] == ["tensor_parallel_size"]
    assert "HybridNixlConnector (pull)" in mismatch_message(pushed, "d", "p", "p")

    wide = dataclasses.replace(make(tensor_parallel_size=4), groups=tuple(halved))
    narrow = dataclasses.replace(make(tensor_parallel_size=2), groups=tuple(halved))
    assert differences(wide, narrow) == []  # a TP 4 decode reads each head whole on two ranks
    for local, remote in ((narrow, wide), (mamba_hybrid(1), mamba_hybrid(2))):
        found = differences(local, remote)  # a decode TP smaller than the prefill's
        assert [item.field for item in found] == ["tensor_parallel_size"]
        assert all(item.per_rank for item in found)
        message = mismatch_message(found, "decode", "prefill", "p")
        assert f"into a smaller decode TP {local.tensor_parallel_size}" in message, message
    # the engine that reads (pull mode: the decode) handshakes, whatever its kv_role
    assert differences(mamba_hybrid(2), mamba_hybrid(1), "prefill") != []

    # a hybrid against a single-group layout: the groups differ, no TP advice (TP 0)
    found = differences(mamba_hybrid(2), make(groups=1, tensor_parallel_size=0))
    assert "tensor_parallel_size" not in {item.field for item in found}
    assert "num_groups" in {item.field for item in found}

    # state strings: strict form, one split dimension, hints by state kind
    def with_state(tp: int, state: str) -> LayoutFingerprint:
        hybrid = mamba_hybrid(tp)
        mamba = dataclasses.replace(hybrid.groups[1], state=state)
        return dataclasses.replace(hybrid, groups=(hybrid.groups[0], mamba))

    cases = {
        "unparsed": ("mamba2 garbage float32", "mamba2 garbage float32", "cannot be compared"),
        "conv layout SD vs DS": (
            "mamba2 (160,3)+(4,32,16) float32+float32",
            "mamba2 (3,320)+(8,32,16) float32+float32",
            "n_groups",
        ),
        "replicated": ("gdn (4,32,32) float32", "gdn (4,32,32) float32", "heads do not divide"),
        "two dims split": ("gdn (2,16,32) float32", "gdn (4,32,32) float32", "gdn state"),
        "huge dimension": (
            "gdn (2,32," + "9" * 5000 + ") float32",
            "gdn (4,32,32) float32",
            "compared",
        ),
        "dtype count": ("gdn (2,32,32) float32+float16", "gdn (4,32,32) float32", "compared"),
    }
    for name, (decode_state, prefill_state, said) in cases.items():
        found = differences(with_state(2, decode_state), with_state(1, prefill_state))
        assert [item.field for item in found] == ["groups[1].state"], name
        assert said in mismatch_message(found, "d", "p", "p"), name
    split = with_state(2, "gdn (2,32,32) float32"), with_state(1, "gdn (4,32,32) float32")
    assert differences(*split) == []


def test_group_count_difference_is_named() -> None:
    found = differences(make(groups=2), make(groups=4))
    assert "num_groups" in {item.field for item in found}
    assert any(item.field.startswith("groups[3].") and item.local is None for item in found)


def test_stock_peer_is_recognised_and_the_message_says_what_to_do() -> None:
    verdict = compare_with_peer(make(), "ab" * 32)
    assert verdict.stock_peer and not verdict.compatible
    message = stock_peer_message("prefill", "engine-p")
    assert "stock NixlConnector" in message and "HybridNixlConnector" in message
    assert "allow_stock_peer" in message


def test_compatible_peer() -> None:
    verdict = compare_with_peer(make(), make().encode())
    assert verdict.compatible and verdict.differences == [] and verdict.remote == make()
