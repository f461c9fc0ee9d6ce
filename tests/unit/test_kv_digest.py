"""The KV digest over real torch caches: it covers exactly the bytes NIXL moves for a kernel
page (the layout check's block ranges), equals a plain-integer reference, catches a single
flipped byte anywhere in those bytes, and ignores bytes NIXL does not move (Mamba padding).
On a CUDA device the same code gives the same digests (``gpu``: run with ``-m gpu`` where a
GPU is present; CI machines have none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hybrid_nixl.connector.kv_cache_facts import describe_cache
from vllm_hybrid_nixl.connector.kv_digest import PageDigester, page_geometry, reference_digest
from vllm_hybrid_nixl.protocol.block_bytes import block_ranges
from vllm_hybrid_nixl.protocol.layout import MAMBA_KIND, LayerDescription, check_layout

pytestmark = pytest.mark.unit

NUM_BLOCKS = 6


def describe(
    name: str, cache: torch.Tensor, kind: str, group: int, ratio: int, page: int, state: int = 0
) -> LayerDescription:
    return describe_cache(
        name,
        cache,
        spec_kind=kind,
        spec_type="MambaSpec" if kind == MAMBA_KIND else "FullAttentionSpec",
        group_id=group,
        num_blocks=NUM_BLOCKS,
        ratio=ratio,
        page_size=page,
        state_bytes=state,
    )


def caches(device: str = "cpu", ratio: int = 2):
    """Two attention layers (block-major, r kernel pages per block) and one Mamba layer
    whose pages carry 40 bytes of padding after the state."""
    generator = torch.Generator().manual_seed(7)
    attn = [
        torch.randint(
            -(2**15), 2**15, (NUM_BLOCKS * ratio, 2, 16, 4), generator=generator, dtype=torch.int16
        ).to(device)
        for _ in range(2)
    ]
    mamba = torch.randint(0, 255, (NUM_BLOCKS, 296), generator=generator, dtype=torch.uint8).to(
        device
    )
    page = attn[0][0].numel() * 2 * ratio
    layers = [
        describe(f"attn.{i}", cache, "full_attention", 0, ratio, page)
        for i, cache in enumerate(attn)
    ] + [describe("mamba.0", mamba, MAMBA_KIND, 1, ratio, 296, state=256)]
    validated = check_layout(layers)
    tensors = [*attn, mamba]
    return [(item.layer.group_id, t, item) for item, t in zip(validated, tensors, strict=True)]


def moved_bytes(cache: torch.Tensor, item, page: int) -> list[bytes]:
    """The bytes of kernel page ``page`` that NIXL moves, read through the layout check's
    block ranges (absolute addresses) from the storage."""
    storage = cache.untyped_storage()
    raw = bytes(torch.empty(0, dtype=torch.uint8).set_(storage.cpu()).numpy())
    ratio = 1 if item.layer.spec_kind == MAMBA_KIND else item.layer.ratio
    ranges = block_ranges(item, page // ratio)
    per_page = len(ranges) // ratio
    mine = ranges[(page % ratio) * per_page : (page % ratio + 1) * per_page]
    base = storage.data_ptr()
    return [raw[s - base : e - base] for s, e in mine]


def test_digest_equals_the_plain_integer_reference_over_the_moved_bytes() -> None:
    layers = caches()
    digester = PageDigester(layers)
    for group in (0, 1):
        members = [(t, item) for g, t, item in layers if g == group]
        pages = [0, 3, 5] if group == 1 else [0, 1, 7, 11]
        lanes = digester.digest(group, pages)
        for row, page in enumerate(pages):
            expected = reference_digest([moved_bytes(t, item, page) for t, item in members])
            assert (int(lanes[row][0]), int(lanes[row][1])) == expected


@pytest.mark.parametrize("where", ["attention", "mamba-state", "mamba-padding"])
def test_one_flipped_byte_changes_exactly_its_page_unless_nixl_does_not_move_it(where) -> None:
    layers = caches()
    digester = PageDigester(layers)
    group, page = (0, 7) if where == "attention" else (1, 4)
    before = digester.digest(group, list(range(12 if group == 0 else NUM_BLOCKS)))
    _, cache, item = layers[1] if where == "attention" else layers[2]
    geometry = page_geometry(item)
    offset = geometry.base + page * geometry.stride
    offset += 13 if where != "mamba-padding" else 260  # past the 256 state bytes
    flat = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())
    flat[offset] ^= 0x10
    after = digester.digest(group, list(range(12 if group == 0 else NUM_BLOCKS)))
    changed = [p for p in range(len(before)) if not np.array_equal(before[p], after[p])]
    assert changed == ([] if where == "mamba-padding" else [page])


def test_another_prompts_page_in_the_same_place_differs() -> None:
    layers = caches()
    digester = PageDigester(layers)
    lanes = digester.digest(0, list(range(12)))
    assert len({(int(a), int(b)) for a, b in lanes}) == 12


@pytest.mark.gpu
def test_cuda_digests_equal_the_cpu_digests() -> None:
    """Needs a CUDA device (none on CI machines): the torch path on the GPU, no host copy of
    the pages, must give the CPU's digests for the same bytes."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    on_cpu = PageDigester(caches("cpu"))
    on_gpu = PageDigester(caches("cuda"))
    for group, pages in ((0, list(range(12))), (1, list(range(NUM_BLOCKS)))):
        assert np.array_equal(on_cpu.digest(group, pages), on_gpu.digest(group, pages))
