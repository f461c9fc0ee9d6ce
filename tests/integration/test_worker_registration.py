"""Real vLLM NIXL workers (ours and stock) on real KV-cache layouts, real NIXL bytes moved.

Everything is real (vLLM's VllmConfig/KVCacheConfig for the tiny hybrid model, vLLM's
worker classes, NIXL agents over UCX) except the kernel block size: on CPU vLLM always
chooses r = 1, so r > 1 is produced by making the CPU attention backend report a fixed,
smaller kernel block size, as a GPU kernel would (see ``harness.kernel_block_size``).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.harness import worker_harness as harness
from tests.harness.releases import STOCK_REFUSAL, stock_is_strict
from vllm_hybrid_nixl.protocol.layout import HybridLayoutError

pytestmark = pytest.mark.integration

RATIO_TO_KERNEL = {1: None, 2: harness.BLOCK_SIZE // 2, 4: harness.BLOCK_SIZE // 4}


def stock_worker_class() -> type:
    from vllm_hybrid_nixl.connector import compat

    return compat.nixl_classes().pull_worker


@pytest.fixture(scope="module")
def setup(tiny_hybrid_model) -> Iterator[harness.ModelSetup]:
    with harness.model_setup(str(tiny_hybrid_model)) as model_setup:
        yield model_setup


def make_worker(
    setup: harness.ModelSetup, ratio: int, cls: type | None = None, kv_cache_config=None
):
    from vllm_hybrid_nixl.connector.worker import HybridNixlPullWorker

    cls = cls or HybridNixlPullWorker
    with harness.kernel_block_size(RATIO_TO_KERNEL[ratio]):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(setup.vllm_config):
            worker = cls(
                setup.vllm_config, str(uuid.uuid4()), kv_cache_config or setup.kv_cache_config
            )
    assert worker._physical_blocks_per_logical_kv_block == ratio
    return worker


@contextmanager
def started_worker(
    setup: harness.ModelSetup, ratio: int, cls: type | None = None, kv_cache_config=None
) -> Iterator:
    """:func:`make_worker`, shut down (its NIXL agent and threads) when the block ends."""
    worker = make_worker(setup, ratio, cls, kv_cache_config)
    try:
        yield worker
    finally:
        worker.shutdown()


def compare_blocks(src: harness.Caches, dst: harness.Caches, nb: int, chosen: list[int]):
    """(requested blocks that differ, unrequested blocks that changed), per layer region."""
    wrong, stray = [], []
    for region in sorted(set(src.layer_regions.values())):
        for block in range(nb):
            copied, original = dst.block_bytes(region, block), src.block_bytes(region, block)
            if block in chosen and not torch.equal(copied, original):
                wrong.append((region, block))
            if block not in chosen and copied.any():
                stray.append((region, block))
    stray += [("padding", index) for index, pad in enumerate(dst.padding_bytes()) if pad.any()]
    return wrong, stray


def transfer(setup: harness.ModelSetup, form: str, ratio: int, cls: type | None = None):
    """Register ``form`` caches on a prefill and a decode worker, READ 3 blocks, compare."""
    prefill, decode = make_worker(setup, ratio, cls), make_worker(setup, ratio, cls)
    try:
        src = harness.allocate_caches(setup.kv_cache_config, form, ratio, seed=7)
        dst = harness.allocate_caches(setup.kv_cache_config, form, ratio, seed=None)
        prefill.register_kv_caches(src.views)
        decode.register_kv_caches(dst.views)
        nb = setup.kv_cache_config.num_blocks
        chosen = [1, 3, nb - 1]
        moved = harness.read_blocks(decode, prefill, chosen)
        forms = {item.form.value for item in getattr(prefill, "validated_layers", [])}
        return moved, compare_blocks(src, dst, nb, chosen), forms, src
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_the_model_really_is_hybrid(setup: harness.ModelSetup) -> None:
    kinds = {type(group.kv_cache_spec).__name__ for group in setup.kv_cache_config.kv_cache_groups}
    assert kinds == {"FullAttentionSpec", "SlidingWindowSpec"}
    caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=None)
    assert len(set(caches.layer_regions.values())) < len(caches.layer_regions), (
        "HMA should overlay the full-attention and sliding-window groups"
    )


LEGAL_CASES = [  # with r = 1 the physical form is the logical form
    (form, ratio)
    for ratio in (1, 2, 4)
    for form in ("logical", "physical", "flat")
    if not (form == "physical" and ratio == 1)
]


@pytest.mark.parametrize(("form", "ratio"), LEGAL_CASES)
def test_each_legal_layout_registers_and_moves_the_right_bytes(
    setup: harness.ModelSetup, form: str, ratio: int
) -> None:
    moved, (wrong, stray), forms, src = transfer(setup, form, ratio)
    assert forms == {form}
    regions = len(set(src.layer_regions.values()))
    assert moved == 3 * src.page_size * regions
    assert wrong == [] and stray == []


def test_blocks_further_apart_than_a_page_move_right_or_are_refused(
    setup: harness.ModelSetup,
) -> None:
    """Views whose blocks lie two pages apart. Releases whose NIXL worker steps by the
    tensor's stride (0.30+): registered, and a real NIXL read moves exactly the requested
    blocks, the padding between them untouched. Earlier releases step by the page, which
    would read the padding as the next block: refused, naming the release to use."""
    from vllm_hybrid_nixl.connector import compat

    if not compat.stock_block_strides_from_tensor():
        worker = make_worker(setup, 1)
        try:
            caches = harness.allocate_caches(setup.kv_cache_config, "strided", 1, seed=1)
            with pytest.raises(HybridLayoutError, match="vLLM 0.30 or newer"):
                worker.register_kv_caches(caches.views)
        finally:
            worker.shutdown()
        return
    moved, (wrong, stray), forms, src = transfer(setup, "strided", 1)
    assert forms == {"logical"}
    assert moved == 3 * src.page_size * len(set(src.layer_regions.values()))
    assert wrong == [] and stray == []


def test_registration_is_vllms_own_for_the_physical_form(setup: harness.ModelSetup) -> None:
    """Ours and the stock worker advertise the same regions for vLLM's own layout (on the
    strict releases the stock worker cannot register that layout at all; ours can)."""
    ours, stock = make_worker(setup, 2), make_worker(setup, 2, stock_worker_class())
    try:
        caches = harness.allocate_caches(setup.kv_cache_config, "physical", 2, seed=1)
        ours.register_kv_caches(caches.views)
        if stock_is_strict():
            with pytest.raises(AssertionError, match=STOCK_REFUSAL):
                stock.register_kv_caches(caches.views)
            assert len(harness.advertised_metadata(ours).kv_caches_base_addr) > 0
            return
        stock.register_kv_caches(caches.views)
        a, b = harness.advertised_metadata(ours), harness.advertised_metadata(stock)
        # block_strides and region_num_blocks exist from vLLM 0.30 on
        fields = ("kv_caches_base_addr", "block_lens", "block_strides", "region_num_blocks")
        present = [name for name in fields if hasattr(a, name)]
        assert present[:2] == ["kv_caches_base_addr", "block_lens"]
        assert [getattr(a, name) for name in present] == [getattr(b, name) for name in present]
    finally:
        ours.shutdown()
        stock.shutdown()


def test_legal_nb_by_ps_form_with_stock_and_with_us(setup: harness.ModelSetup) -> None:
    """[NB, PS] with r != 1 is legal (HMA lays pages out densely). vLLM 0.24-0.25 refuse it
    (strict block count). 0.30+ take block strides from the tensor's first dimension and
    register it as NB*r blocks of PS bytes, so a READ of logical block b fetches other bytes:
    silent corruption. 0.26-0.29 derive offsets from page sizes and move the right bytes.
    Ours registers it and moves the right bytes on every release."""
    from vllm_hybrid_nixl.connector import compat

    stock_class = compat.nixl_classes().pull_worker
    if stock_is_strict():  # 0.24-0.25, the central claim: the stock worker refuses it
        with pytest.raises(AssertionError, match=STOCK_REFUSAL):
            transfer(setup, "logical", 2, stock_class)
    else:
        _, (wrong, stray), _, _ = transfer(setup, "logical", 2, stock_class)
        if compat.stock_block_strides_from_tensor():
            assert wrong and stray, "the stock worker was expected to move the wrong blocks"
        else:
            assert wrong == [] and stray == []
    _, (wrong, stray), _, _ = transfer(setup, "logical", 2)
    assert wrong == [] and stray == []


def test_too_few_blocks_with_r_not_1_pass_vllm_but_not_us(setup: harness.ModelSetup) -> None:
    """A layer with its own allocation whose view holds half the kernel blocks."""
    caches = harness.allocate_caches(setup.kv_cache_config, "physical", 2, seed=1).views
    victim = sorted(caches)[0]
    full = caches[victim].clone()  # own storage of NB*r kernel blocks
    caches[victim] = full[: full.shape[0] // 2]

    stock = make_worker(setup, 2, stock_worker_class())
    try:
        if stock_is_strict():  # refuses this (and every other CPU cache)
            with pytest.raises(AssertionError, match=STOCK_REFUSAL):
                stock.register_kv_caches(caches)
        else:
            stock.register_kv_caches(caches)  # 0.26+ skip their block check when r != 1
    finally:
        stock.shutdown()
    ours = make_worker(setup, 2)
    try:
        with pytest.raises(HybridLayoutError, match=f"layer '{victim}'.*first dimension is"):
            ours.register_kv_caches(caches)
    finally:
        ours.shutdown()


def test_shared_storage_with_different_page_sizes_passes_vllm_but_not_us(
    setup: harness.ModelSetup,
) -> None:
    """The sliding-window group's spec says half the page size of the full group it overlays."""
    config = setup.kv_cache_config
    sliding = next(
        g for g in config.kv_cache_groups if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"
    )
    half = dataclasses.replace(
        sliding.kv_cache_spec, head_size=sliding.kv_cache_spec.head_size // 2
    )
    groups = [
        dataclasses.replace(g, kv_cache_spec=half) if g is sliding else g
        for g in config.kv_cache_groups
    ]
    bad_config = dataclasses.replace(config, kv_cache_groups=groups)
    caches = harness.allocate_caches(bad_config, "physical", 2, seed=1).views

    stock = make_worker(setup, 2, stock_worker_class(), kv_cache_config=bad_config)
    try:
        if stock_is_strict():
            with pytest.raises(AssertionError, match=STOCK_REFUSAL):
                stock.register_kv_caches(caches)
        else:
            stock.register_kv_caches(caches)  # one region per shared address: silently wrong
    finally:
        stock.shutdown()
    ours = make_worker(setup, 2, kv_cache_config=bad_config)
    try:
        with pytest.raises(HybridLayoutError, match="overlap those of layer"):
            ours.register_kv_caches(caches)
    finally:
        ours.shutdown()


@pytest.mark.parametrize("ratio", [1, 4])
def test_handshake_carries_the_layout_fingerprint(setup: harness.ModelSetup, ratio: int) -> None:
    """What a peer receives in the handshake decodes to this engine's real groups and r."""
    from vllm_hybrid_nixl.protocol.fingerprint import decode

    worker = make_worker(setup, ratio)
    try:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", ratio, seed=None)
        worker.register_kv_caches(caches.views)
        wire = worker.xfer_handshake_metadata.compatibility_hash
        assert wire == worker.compat_hash  # vLLM compares this very string with the peer's
        fingerprint = decode(wire)
        groups = setup.kv_cache_config.kv_cache_groups
        assert len(fingerprint.groups) == len(groups) >= 2
        assert {g.kind for g in fingerprint.groups} == {"sliding_window", "full_attention"}
        for group in fingerprint.groups:
            assert group.block_size == harness.BLOCK_SIZE
            assert group.ratio == ratio
            assert group.kernel_block_size * ratio == harness.BLOCK_SIZE
        assert fingerprint.transfer_mode == "pull"
        assert len(fingerprint.vllm_compat_hash) == 64  # vLLM's own hash, kept inside
    finally:
        worker.shutdown()


def test_kv_leading_cache_moves_both_halves_or_is_refused(setup: harness.ModelSetup) -> None:
    """K/V-leading ``[2, NB*r, ...]`` caches (ROCm attention's layout): on 0.24-0.25, whose
    registration makes K and V separate regions, ours hands them over as they are and the
    right K and V blocks arrive; later releases register one region per layer, so ours
    refuses them with the reason instead of moving the wrong bytes."""
    ratio = 2
    prefill, decode = make_worker(setup, ratio), make_worker(setup, ratio)
    try:
        src = harness.allocate_caches(setup.kv_cache_config, "kv_split", ratio, seed=3)
        dst = harness.allocate_caches(setup.kv_cache_config, "kv_split", ratio, seed=None)
        if not stock_is_strict():
            with pytest.raises(HybridLayoutError, match="is K/V-leading .* blocks-first"):
                prefill.register_kv_caches(src.views)
            return
        prefill.register_kv_caches(src.views)
        decode.register_kv_caches(dst.views)
        assert {item.form.value for item in prefill.validated_layers} == {"kv_split"}
        nb = setup.kv_cache_config.num_blocks
        chosen = [0, 2, nb - 1]
        harness.read_blocks(decode, prefill, chosen)
        for name in sorted({n for n in src.views}):
            for block in range(nb):
                rows = slice(block * ratio, (block + 1) * ratio)
                # compare bits: random bytes seen as float32 include NaNs
                got = dst.views[name][:, rows].view(torch.int32)
                sent = src.views[name][:, rows].view(torch.int32)
                if block in chosen:
                    assert torch.equal(got, sent), (name, block)
                else:
                    assert not got.any(), (name, block)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_side_channel_request_form_read_from_the_version_matches_the_worker() -> None:
    """The router picks the side-channel request form from vLLM's version (no vLLM import);
    the installed worker's own handshake signature must agree (run on each matrix release)."""
    from vllm_hybrid_nixl.connector import compat

    assert compat.side_channel_wants_pp_rank() == compat.handshake_takes_pp_rank()


def test_a_cache_without_a_spec_that_is_no_layers_cache_is_refused(
    setup: harness.ModelSetup,
) -> None:
    caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=3).views
    stray = torch.zeros_like(next(iter(caches.values())))  # bytes of its own, no spec
    ours = make_worker(setup, 1)
    try:
        with pytest.raises(HybridLayoutError, match="layer 'model.layers.99.stray'.*no KV-cache"):
            ours.register_kv_caches({**caches, "model.layers.99.stray": stray})
    finally:
        ours.shutdown()


def test_a_cache_without_a_spec_that_shares_a_layers_bytes_is_accepted(
    setup: harness.ModelSetup,
) -> None:
    """vLLM's KV sharing: a layer reusing another layer's cache has no spec of its own."""
    caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=4).views
    first = sorted(caches)[0]
    ours = make_worker(setup, 1)
    try:
        ours.register_kv_caches({**caches, "model.layers.99.shared": caches[first]})
    finally:
        ours.shutdown()


def test_a_release_without_the_kernel_block_ratio_is_refused_by_name(
    setup: harness.ModelSetup,
) -> None:
    caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=5).views
    ours = make_worker(setup, 1)
    try:
        del ours._physical_blocks_per_logical_kv_block  # as if vLLM had renamed it
        with pytest.raises(HybridLayoutError, match="_physical_blocks_per_logical_kv_block"):
            ours.register_kv_caches(caches)
    finally:
        ours.shutdown()
