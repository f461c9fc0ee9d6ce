"""The layout fingerprint: wire form, comparison and the messages users read."""

from __future__ import annotations

import dataclasses

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


def test_tensor_parallel_mismatch_matters_only_for_hybrid_models() -> None:
    assert differences(make(groups=1), make(groups=1, tensor_parallel_size=2)) == []
    found = differences(make(groups=2), make(groups=2, tensor_parallel_size=2))
    assert [item.field for item in found] == ["tensor_parallel_size"]


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
