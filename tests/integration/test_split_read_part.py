"""Which part of each prefill page a decode rank of a larger TP reads: ours
(``tp_split.read_part``, what the KV digest asks the prefill for) against vLLM's own TP
mapping (``compute_tp_mapping``'s head offset, the one its NIXL worker reads at), for every
decode rank over KV head counts and TP pairs, including decode TPs above the head count
(heads replicated on several ranks)."""

from __future__ import annotations

import itertools

import pytest

from vllm_hybrid_nixl.protocol.tp_split import read_part

pytestmark = pytest.mark.integration

CASES = [
    (heads, prefill_tp, decode_tp)
    for heads, (prefill_tp, decode_tp) in itertools.product(
        [1, 2, 4, 8], [(1, 2), (1, 4), (2, 4), (1, 8), (2, 8), (4, 8), (2, 2)]
    )
]


def vllm_offset(
    heads: int, prefill_tp: int, decode_tp: int, rank: int, is_mla: bool = False
) -> int:
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (
        compute_tp_mapping,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topology = TransferTopology(
        tp_rank=rank, tp_size=decode_tp, block_size=16, engine_id="decode", is_mla=is_mla,
        is_mamba=False, total_num_kv_heads=heads, attn_backends=[],
    )  # fmt: skip
    return compute_tp_mapping(topology, prefill_tp, (FullAttentionSpec,)).rank_offset_factor


@pytest.mark.parametrize(("heads", "prefill_tp", "decode_tp"), CASES)
def test_attention_part_is_where_vllm_reads(heads: int, prefill_tp: int, decode_tp: int) -> None:
    prefill_heads = max(1, heads // prefill_tp)
    decode_heads = max(1, heads // decode_tp)
    for rank in range(decode_tp):
        part = read_part(False, decode_tp, prefill_tp, rank, heads)
        assert not isinstance(part, str), part
        ratio, index = part
        assert ratio == prefill_heads // decode_heads
        # vLLM reads rank_offset_factor x (its own page) into the prefill's page
        expected = vllm_offset(heads, prefill_tp, decode_tp, rank) if ratio > 1 else 0
        assert index == expected, (rank, part)


def test_state_parts_and_refusals() -> None:
    assert [read_part(True, 4, 2, rank, 0) for rank in range(4)] == [(2, 0), (2, 1)] * 2
    assert "larger than the decode TP" in str(read_part(True, 1, 2, 0, 8))
    assert "do not divide" in str(read_part(False, 3, 2, 0, 8))
    assert "KV head count" in str(read_part(False, 2, 1, 0, 0))


def test_mla_is_read_whole_as_vllm_reads_it() -> None:
    """MLA: vLLM's topology counts one KV head (the latent every rank holds) and reads the
    whole page at offset 0, whatever the model config's KV head count; so do we, with the
    head count taken from that topology."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    from vllm_hybrid_nixl.connector.compat import transfer_kv_heads

    topology = TransferTopology(
        tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=True,
        is_mamba=False, total_num_kv_heads=1, attn_backends=[],
    )  # fmt: skip
    heads = transfer_kv_heads(SimpleNamespace(transfer_topo=topology, use_mla=True))
    assert heads == 1
    for rank in range(2):
        assert read_part(False, 2, 1, rank, heads) == (1, 0)
        assert vllm_offset(1, 1, 2, rank, is_mla=True) == 0
