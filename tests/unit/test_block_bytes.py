"""The byte-range arithmetic of the registration audit, against a brute-force byte set."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hybrid_nixl.protocol.block_bytes import block_ranges, merge_ranges, subtract_ranges
from vllm_hybrid_nixl.protocol.layout import LayerDescription, LayoutForm, ValidatedLayer

pytestmark = pytest.mark.unit

RANGES = st.lists(
    st.tuples(st.integers(0, 80), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=10,
)


def _bytes(ranges: list[tuple[int, int]]) -> set[int]:
    return {b for start, end in ranges for b in range(start, end)}


@given(RANGES)
def test_merging_keeps_exactly_the_bytes_sorted_and_disjoint(ranges) -> None:
    merged = merge_ranges(ranges)
    assert _bytes(merged) == _bytes(ranges)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:], strict=False))


@given(RANGES, RANGES)
def test_subtracting_leaves_exactly_the_uncovered_bytes(first, second) -> None:
    left = subtract_ranges(merge_ranges(first), merge_ranges(second))
    assert _bytes(left) == _bytes(first) - _bytes(second)


def _layer(shape, stride, ratio, page) -> LayerDescription:
    return LayerDescription(
        name="model.layers.0.attn",
        spec_kind="full_attention",
        spec_type="FullAttentionSpec",
        group_id=0,
        num_blocks=4,
        ratio=ratio,
        page_size=page,
        shape=shape,
        stride=stride,
        element_size=1,
        dtype="uint8",
        data_ptr=1000,
        storage_ptr=1000,
        storage_nbytes=1 << 16,
    )


def test_a_block_is_its_r_kernel_pages_in_each_form() -> None:
    logical = ValidatedLayer(_layer((4, 64), (64, 1), 2, 64), LayoutForm.LOGICAL, 64, 256)
    physical = ValidatedLayer(_layer((8, 32), (32, 1), 2, 64), LayoutForm.PHYSICAL, 32, 256)
    strided = ValidatedLayer(_layer((4, 64), (128, 1), 1, 64), LayoutForm.LOGICAL, 128, 512)
    assert merge_ranges(block_ranges(logical, 2)) == [(1128, 1192)]
    assert merge_ranges(block_ranges(physical, 2)) == [(1128, 1192)]
    assert block_ranges(strided, 3) == [(1384, 1448)]
