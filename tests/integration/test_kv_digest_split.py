"""Split-read digests over real torch caches: a prefill worker's cells add up to its page
digest, and the part a decode rank of a larger TP received (its heads of a K/V-split cache;
its slices of a Mamba2 conv state's x, B and C and of its temporal state, as vLLM's NIXL
worker reads them) digests to exactly the prefill's cells of that part; one flipped byte in
the received slice changes exactly its page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hybrid_nixl.connector.kv_cache_facts import describe_cache
from vllm_hybrid_nixl.connector.kv_digest import CellPlan, PageDigester, plan_cells
from vllm_hybrid_nixl.protocol.digest_wire import part_of_cells
from vllm_hybrid_nixl.protocol.layout import MAMBA_KIND, check_layout

pytestmark = pytest.mark.integration

BLOCKS = 5
HEADS, TOKENS, DIM = 4, 16, 8
#: Mamba2 conv state (DS: one row of CONV_ROWS values per channel): x, B, C channels.
X, B, CONV_ROWS = 16, 8, 3
SSM_HEADS, SSM_DIM, SSM_STATE = 4, 4, 8


def attention(cache: torch.Tensor, group: int = 0):
    """A K/V-split attention layer ``[2, blocks, heads, tokens, dim]`` (block-contiguous)."""
    page = cache[:, 0].numel() * cache.element_size()
    layer = describe_cache(
        "attn.0", cache, spec_kind="full_attention", spec_type="FullAttentionSpec",
        group_id=group, num_blocks=cache.shape[1], ratio=1, page_size=page,
    )  # fmt: skip
    [validated] = check_layout([layer])
    return (group, cache, validated)


def mamba_page(conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    """One page's state bytes: the conv state, then the temporal state."""
    return torch.cat([conv.reshape(-1).view(torch.uint8), ssm.reshape(-1).view(torch.uint8)])


def mamba(pages: torch.Tensor, state_bytes: int):
    layer = describe_cache(
        "mamba.0", pages, spec_kind=MAMBA_KIND, spec_type="MambaSpec", group_id=0,
        num_blocks=pages.shape[0], ratio=1, page_size=pages.shape[1], state_bytes=state_bytes,
    )  # fmt: skip
    [validated] = check_layout([layer])
    return (0, pages, validated)


def mamba_regions(x: int, b: int, ssm_bytes: int) -> list[list[tuple[int, int]]]:
    row = CONV_ROWS * 4
    sizes = [x * row, b * row, b * row, ssm_bytes]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    return [list(zip(starts, sizes, strict=True))]


def test_cells_add_up_to_the_whole_page_digest() -> None:
    cache = torch.randn(2, BLOCKS, HEADS, TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    half = HEADS * TOKENS * DIM * 4
    plan = plan_cells([[(0, half)], [(0, half)]])
    assert plan is not None and plan.cells == 4
    whole = PageDigester([attention(cache)]).digest(0, [0, 2, 4])
    lanes, cells = PageDigester([attention(cache)], {0: plan}).digest_cells(0, [0, 2, 4])
    assert np.array_equal(lanes, whole)
    assert cells is not None and cells.shape == (3, 2, 4, 2)
    assert np.array_equal(part_of_cells(cells, 1, 0), whole)


@pytest.mark.parametrize("ratio", [2, 4])
def test_a_decode_ranks_heads_digest_to_the_prefills_cells_of_its_part(ratio: int) -> None:
    generator = torch.Generator().manual_seed(2)
    prefill = torch.randn(2, BLOCKS, HEADS, TOKENS, DIM, generator=generator)
    half = HEADS * TOKENS * DIM * 4
    prefill_plan = plan_cells([[(0, half)], [(0, half)]])
    assert prefill_plan is not None
    _, cells = PageDigester([attention(prefill)], {0: prefill_plan}).digest_cells(0, [1, 3])
    assert cells is not None
    heads = HEADS // ratio
    local_half = heads * TOKENS * DIM * 4
    local_plan = plan_cells([[(0, local_half)], [(0, local_half)]])
    assert local_plan is not None
    for part in range(ratio):
        # the decode rank's pages 0 and 4 received prefill pages 1 and 3, its heads only
        local = torch.zeros(2, BLOCKS, heads, TOKENS, DIM)
        local[:, 0] = prefill[:, 1, part * heads : (part + 1) * heads]
        local[:, 4] = prefill[:, 3, part * heads : (part + 1) * heads]
        digester = PageDigester([attention(local)], {0: local_plan})
        got = digester.digest_mapped(0, [0, 4], ratio, part)
        assert np.array_equal(got, part_of_cells(cells, ratio, part))
        other = part_of_cells(cells, ratio, (part + 1) % ratio)
        assert not np.array_equal(got[0], other[0])  # another rank's heads differ
        local.view(torch.uint8).view(-1)[local[0].numel() * 4 + 5] ^= 0x01  # V of page 0
        flipped = digester.digest_mapped(0, [0, 4], ratio, part)
        assert not np.array_equal(flipped[0], got[0])
        assert np.array_equal(flipped[1], got[1])


def test_a_decode_ranks_mamba2_slices_digest_to_the_prefills_cells_of_its_part() -> None:
    """vLLM's 3-read: decode rank ``j`` of TP ratio 2 reads part ``j`` of x, of B, of C and of
    the temporal state's heads; its page holds them one after the other."""
    generator = torch.Generator().manual_seed(3)
    ratio = 2
    conv = torch.randn(BLOCKS, X + 2 * B, CONV_ROWS, generator=generator)
    ssm = torch.randn(BLOCKS, SSM_HEADS, SSM_DIM, SSM_STATE, generator=generator)
    state = (X + 2 * B) * CONV_ROWS * 4 + SSM_HEADS * SSM_DIM * SSM_STATE * 4
    pages = torch.stack([mamba_page(conv[i], ssm[i]) for i in range(BLOCKS)])
    padded = torch.cat([pages, torch.zeros(BLOCKS, 24, dtype=torch.uint8)], dim=1)
    plan = plan_cells(mamba_regions(X, B, SSM_HEADS * SSM_DIM * SSM_STATE * 4))
    assert plan is not None and plan.cells == 4
    _, cells = PageDigester([mamba(padded, state)], {0: plan}).digest_cells(0, [2])
    assert cells is not None and cells.shape == (1, 4, 4, 2)
    x, b, heads = X // ratio, B // ratio, SSM_HEADS // ratio
    local_ssm_bytes = heads * SSM_DIM * SSM_STATE * 4
    local_plan = plan_cells(mamba_regions(x, b, local_ssm_bytes))
    assert isinstance(local_plan, CellPlan)
    for part in range(ratio):
        rows = conv[2]
        mine = torch.cat(
            [
                rows[part * x : (part + 1) * x],
                rows[X + part * b : X + (part + 1) * b],
                rows[X + B + part * b : X + B + (part + 1) * b],
            ]
        )
        local_page = mamba_page(mine, ssm[2, part * heads : (part + 1) * heads])
        local = torch.zeros(BLOCKS, local_page.numel() + 8, dtype=torch.uint8)
        local[3, : local_page.numel()] = local_page
        digester = PageDigester([mamba(local, local_page.numel())], {0: local_plan})
        got = digester.digest_mapped(0, [3], ratio, part)
        assert np.array_equal(got, part_of_cells(cells, ratio, part))
        local[3, x * CONV_ROWS * 4 + 1] ^= 0x02  # a byte of its B slice
        assert not np.array_equal(digester.digest_mapped(0, [3], ratio, part), got)


def test_a_cut_that_cannot_fall_on_words_has_no_plan() -> None:
    assert plan_cells([[(0, 12)]]) is None  # not whole words
    assert plan_cells([[(8, 16)]]) is None  # does not start the piece
    single = plan_cells([[(0, 24)]])
    assert single is not None and single.cells == 1
    with pytest.raises(ValueError, match="does not fall on"):
        part_of_cells(np.zeros((1, 1, 1, 2), dtype=np.uint64), 2, 0)
