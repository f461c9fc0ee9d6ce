"""Every accepted and rejected form of the HMA-aware layout check (pure, no vLLM)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hybrid_nixl.protocol.layout import (
    HybridLayoutError,
    LayerDescription,
    LayoutForm,
    check_layout,
    validate_layer,
)

pytestmark = pytest.mark.unit

BASE = 1 << 20  # a fake storage address; only differences between addresses matter


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def layer(
    shape: tuple[int, ...],
    *,
    nb: int = 8,
    r: int = 1,
    ps: int = 1024,
    kind: str = "full_attention",
    element_size: int = 2,
    stride: tuple[int, ...] | None = None,
    offset: int = 0,
    storage_nbytes: int | None = None,
    storage: int = BASE,
    name: str = "model.layers.0.self_attn.attn",
) -> LayerDescription:
    stride = stride if stride is not None else contiguous_strides(shape)
    if storage_nbytes is None:
        storage_nbytes = offset + math.prod(shape) * element_size
    return LayerDescription(
        name=name,
        spec_kind=kind,
        spec_type={"mamba": "MambaSpec", "sliding_window": "SlidingWindowSpec"}.get(
            kind, "FullAttentionSpec"
        ),
        group_id=1,
        num_blocks=nb,
        ratio=r,
        page_size=ps,
        shape=shape,
        stride=stride,
        element_size=element_size,
        dtype="bfloat16" if element_size == 2 else "uint8",
        data_ptr=storage + offset,
        storage_ptr=storage,
        storage_nbytes=storage_nbytes,
    )


# ---- accepted forms --------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("kind", ["full_attention", "sliding_window", "chunked_local", "mla"])
def test_logical_form_nb_by_ps_is_accepted(r: int, kind: str) -> None:
    # [NB, PS]: 8 blocks of 1024 bytes = 512 bf16 elements, split as [H=2, N=16, C=16].
    result = validate_layer(layer((8, 2, 16, 16), r=r, kind=kind))
    assert result.form is LayoutForm.LOGICAL
    assert result.block_stride == 1024
    assert result.needs_physical_view is (r != 1)
    assert result.physical_page_size == 1024 // r


@pytest.mark.parametrize("r", [2, 4])
def test_physical_form_nbr_by_ps_over_r_is_accepted(r: int) -> None:
    page_elems = 512 // r
    result = validate_layer(layer((8 * r, 2, page_elems // 32, 16), r=r))
    assert result.form is LayoutForm.PHYSICAL
    assert result.block_stride == 1024 // r
    assert not result.needs_physical_view


def test_flat_view_of_at_least_nb_ps_bytes_is_accepted() -> None:
    result = validate_layer(layer((8 * 1024 + 64,), element_size=1, r=2))
    assert result.form is LayoutForm.FLAT
    assert result.needs_physical_view


def test_block_major_with_interleaved_rows_is_accepted() -> None:
    # Block-outermost packing (BLHNC): rows of 2 layers, this layer's page is the first half.
    result = validate_layer(layer((8, 512), stride=(1024, 1), storage_nbytes=8 * 2048, r=1))
    assert result.form is LayoutForm.LOGICAL and result.block_stride == 2048


def test_permuted_but_dense_block_interior_is_accepted() -> None:
    # [NB, H, N, C] viewed with H and N swapped in memory (NHD vs HND) stays one dense page.
    shape = (8, 2, 16, 16)
    stride = (512, 16, 32, 1)
    assert validate_layer(layer(shape, stride=stride)).form is LayoutForm.LOGICAL


def test_padded_page_with_exact_stride_is_accepted() -> None:
    # 960 bytes of content padded to a 1024-byte page (HMA page padding).
    result = validate_layer(layer((8, 480), stride=(512, 1), storage_nbytes=8 * 1024))
    assert result.form is LayoutForm.LOGICAL


def test_mamba_state_per_logical_block_is_accepted_for_any_r() -> None:
    result = validate_layer(layer((8, 512), kind="mamba", r=4))
    assert result.form is LayoutForm.LOGICAL
    assert result.physical_page_size == 1024
    assert not result.needs_physical_view


def test_layers_sharing_storage_with_equal_pages_are_accepted() -> None:
    shared = [
        layer((8, 512), name="model.layers.0.self_attn.attn", kind="sliding_window"),
        layer((8, 512), name="model.layers.1.self_attn.attn"),
    ]
    assert len(check_layout(shared)) == 2


# ---- rejected forms ---------------------------------------------------------------


def rejection(description: LayerDescription) -> str:
    with pytest.raises(HybridLayoutError) as info:
        check_layout([description])
    return str(info.value)


def test_error_names_layer_spec_group_numbers_shape_forms_and_fix() -> None:
    text = rejection(layer((7, 512), r=2))
    for fragment in (
        "model.layers.0.self_attn.attn",
        "spec=FullAttentionSpec (full_attention)",
        "group=1",
        "NB=8",
        "r=2",
        "PS=1024 bytes",
        "shape=(7, 512)",
        "stride=(512, 1)",
        "dtype=bfloat16",
        "Accepted forms: [8, ...] with a dense page of 1024 bytes and block stride exactly "
        "1024 bytes; [16, ...] with a dense page of 512 bytes; a flat byte view of at least "
        "8192 bytes",
        "What to change:",
    ):
        assert fragment in text, fragment


def test_wrong_block_count_is_rejected_in_both_forms() -> None:
    text = rejection(layer((12, 256), r=2))
    assert "as [NB, ...]: first dimension is 12, expected 8" in text
    assert "as [NB*r, ...]: first dimension is 12, expected 16" in text


def test_too_few_physical_blocks_inside_a_larger_storage_is_rejected() -> None:
    # vLLM 0.26+ skip their block-count check when r != 1; this half-sized view passes there.
    text = rejection(layer((8, 256), r=2, storage_nbytes=16 * 512))
    assert "first dimension is 8, expected 16" in text


def test_short_flat_view_is_rejected() -> None:
    text = rejection(layer((4096,), element_size=1, r=2, storage_nbytes=8192))
    assert "flat view holds 4096 bytes, fewer than NB*PS = 8192" in text


def test_logical_form_with_gaps_between_pages_is_rejected_when_r_is_not_1() -> None:
    # Splitting a logical block into r kernel blocks needs pages that abut.
    text = rejection(layer((8, 512), stride=(1024, 1), storage_nbytes=8 * 2048, r=2))
    assert "block stride is 2048 bytes, expected exactly 1024" in text


def test_page_of_wrong_size_is_rejected() -> None:
    text = rejection(layer((8, 256)))  # 512-byte page where the spec says 1024
    assert "one block holds 512 bytes with a block stride of 512 bytes" in text


def test_non_dense_block_interior_is_rejected() -> None:
    # K/V-leading [2, NB, ...] seen as [NB, 2, ...]: one block's K and V lie far apart.
    text = rejection(layer((8, 2, 256), stride=(256, 8 * 256, 1), storage_nbytes=8192))
    assert "the elements of one block are not dense in memory" in text


def test_view_past_its_storage_is_rejected() -> None:
    text = rejection(layer((8, 512), offset=1024, storage_nbytes=8 * 1024))
    assert "end 1024 bytes past the end of the tensor's storage" in text


def test_mamba_state_with_wrong_block_count_is_rejected() -> None:
    text = rejection(layer((16, 256), kind="mamba", r=2))
    assert "first dimension is 16, expected 8" in text
    assert "one state of 1024 bytes per block" in text


def test_unknown_spec_kind_is_rejected() -> None:
    text = rejection(layer((8, 512), kind="CrossAttentionSpec"))
    assert "spec kind 'CrossAttentionSpec' is not one vllm-hybrid-nixl can transfer" in text


def test_page_not_divisible_by_r_is_rejected() -> None:
    text = rejection(layer((8, 512), r=3))
    assert "does not split into r=3 kernel blocks" in text
    assert "--block-size" in text


def test_layers_sharing_storage_with_different_pages_are_rejected() -> None:
    first = layer((8, 512), name="model.layers.0.self_attn.attn")
    second = layer((8, 256), ps=512, name="model.layers.1.self_attn.attn")
    with pytest.raises(HybridLayoutError) as info:
        check_layout([first, second])
    text = str(info.value)
    assert "layer 'model.layers.1.self_attn.attn'" in text
    assert "overlap those of layer 'model.layers.0.self_attn.attn'" in text
    assert "PS=512 bytes and NB=8" in text


def test_layers_side_by_side_in_one_allocation_may_differ() -> None:
    # vLLM 0.32+ put every layer in one backing buffer; disjoint ranges do not alias.
    first = layer((8, 512), name="model.layers.0.self_attn.attn", storage_nbytes=8 * 1024 + 8 * 512)
    second = layer(
        (8, 256),
        ps=512,
        name="model.layers.1.self_attn.attn",
        offset=8 * 1024,
        storage_nbytes=8 * 1024 + 8 * 512,
    )
    assert len(check_layout([first, second])) == 2


def test_overlapping_layers_off_the_block_grid_are_rejected() -> None:
    first = layer((8, 512), name="model.layers.0.self_attn.attn", storage_nbytes=9 * 1024)
    second = layer(
        (8, 512), name="model.layers.1.self_attn.attn", offset=512, storage_nbytes=9 * 1024
    )
    with pytest.raises(HybridLayoutError, match="starts 512 bytes away, not on a block boundary"):
        check_layout([first, second])


def test_error_is_a_value_error() -> None:
    assert issubclass(HybridLayoutError, ValueError)


# ---- properties ---------------------------------------------------------------------


@given(
    nb=st.integers(1, 64),
    r=st.sampled_from([1, 2, 4, 8]),
    page_elems=st.sampled_from([64, 128, 256]),
    element_size=st.sampled_from([1, 2, 4]),
    physical=st.booleans(),
)
def test_every_legal_block_major_layout_is_accepted(
    nb: int, r: int, page_elems: int, element_size: int, physical: bool
) -> None:
    ps = page_elems * element_size * r
    blocks, elems = (nb * r, page_elems) if physical else (nb, page_elems * r)
    result = validate_layer(layer((blocks, elems), nb=nb, r=r, ps=ps, element_size=element_size))
    expected = LayoutForm.PHYSICAL if physical and r != 1 else LayoutForm.LOGICAL
    assert result.form is expected
    assert result.physical_page_size * r == ps


@given(
    nb=st.integers(2, 64),
    r=st.sampled_from([1, 2, 4]),
    delta=st.integers(-3, 3).filter(lambda d: d != 0),
)
def test_any_other_block_count_is_rejected(nb: int, r: int, delta: int) -> None:
    blocks = max(1, nb * r + delta)
    if blocks in (nb, nb * r):
        return
    page_elems = 64
    with pytest.raises(HybridLayoutError):
        validate_layer(
            layer(
                (blocks, page_elems),
                nb=nb,
                r=r,
                ps=page_elems * 2 * r,
                storage_nbytes=(nb * r + 4) * page_elems * 2,
            )
        )


def test_second_layer_of_a_known_geometry_is_still_bound_checked() -> None:
    ok = layer((8, 512), name="model.layers.0.self_attn.attn")
    past = layer(
        (8, 512),
        name="model.layers.2.self_attn.attn",
        storage=BASE * 4,
        offset=512,
        storage_nbytes=8 * 1024,
    )
    with pytest.raises(HybridLayoutError, match="layers.2.*past the end of the tensor's storage"):
        check_layout([ok, past])


# ---- K/V-leading caches ([2, NB*r, ...], e.g. ROCm attention) ---------------------------


@pytest.mark.parametrize("r", [1, 2, 4])
def test_kv_leading_halves_are_accepted_as_two_block_major_regions(r: int) -> None:
    # PS = 1024 bytes per logical block: K and V halves of NB*r blocks of 512/r bytes each.
    page_elements = 1024 // (2 * r) // 2
    shape = (2, 8 * r, page_elements)
    result = validate_layer(layer(shape, r=r))
    assert result.form is LayoutForm.KV_SPLIT
    assert result.block_stride == 1024 // (2 * r)
    assert not result.needs_physical_view
    assert result.extent == 8 * 1024  # both halves


def test_kv_leading_halves_that_overlap_are_rejected() -> None:
    # the V half starts half-way into the K half
    text = rejection(layer((2, 8, 256), stride=(4 * 256, 256, 1), storage_nbytes=8192))
    assert "as K/V-leading [2, NB*r, ...]: the V half starts 2048 bytes after the K half" in text


def test_kv_leading_with_wrong_block_count_names_the_expected_count() -> None:
    text = rejection(layer((2, 4, 256), r=2, storage_nbytes=4096))
    assert "each half: first dimension is 4, expected 16" in text
    assert "K/V-leading [2, 16, ...] with two dense halves of 16 blocks of 256 bytes" in text
