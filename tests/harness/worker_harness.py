"""Build real vLLM NIXL workers in this process and move real bytes between them.

The VllmConfig and KVCacheConfig are the ones vLLM computes for the tiny hybrid model
(EngineArgs -> VllmConfig, the model's own attention layers -> KV-cache specs ->
``get_kv_cache_configs``).  Caches are allocated the way vLLM's hybrid allocator does:
one raw byte tensor per ``KVCacheTensor``, shared by the layers listed in it, viewed
per layer in the layout under test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

install_cpu_version_alias()

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402

from vllm_hybrid_nixl.preflight.dry_run import kv_cache_setup  # noqa: E402

BLOCK_SIZE = 128  # user block size; r = 128 / kernel block size
KV_CACHE_BYTES = 8 << 20


@dataclass
class ModelSetup:
    vllm_config: Any
    kv_cache_config: Any


@contextlib.contextmanager
def model_setup(model_dir: str, kv_cache_bytes: int = KV_CACHE_BYTES) -> Iterator[ModelSetup]:
    """Real VllmConfig + KVCacheConfig for ``model_dir``, with vLLM's distributed state up."""
    engine_args = EngineArgs(
        model=model_dir,
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK_SIZE,
        load_format="dummy",
        kv_transfer_config={
            "kv_connector": "HybridNixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        },
    )
    with kv_cache_setup(engine_args, kv_cache_bytes, device="cpu") as setup:
        yield ModelSetup(setup.vllm_config, setup.kv_cache_config)


@contextlib.contextmanager
def kernel_block_size(size: int | None) -> Iterator[None]:
    """Make the CPU attention backend report one fixed kernel block size.

    On CPU the backend accepts any multiple of 32, so vLLM always picks r = 1; a GPU
    kernel with a smaller fixed block size gives r = block_size / kernel_block_size.
    This is the one thing faked here, because it needs a GPU kernel to be real.
    """
    if size is None:
        yield
        return
    original = CPUAttentionBackend.__dict__["get_supported_kernel_block_sizes"]
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(  # type: ignore[method-assign]
        lambda kv_cache_spec=None: [size]
    )
    try:
        yield
    finally:
        CPUAttentionBackend.get_supported_kernel_block_sizes = original  # type: ignore[method-assign]


@dataclass
class Caches:
    """The backing buffers and the per-layer views vLLM's registration receives."""

    buffers: list[torch.Tensor]
    views: dict[str, torch.Tensor]
    #: layer -> (buffer index, byte offset of its block 0); layers of an HMA overlay share one
    layer_regions: dict[str, tuple[int, int]]
    page_size: int
    block_stride: int = 0  # bytes from one block to the next; 0: the page size

    def block_bytes(self, region: tuple[int, int], block: int) -> torch.Tensor:
        buffer, start = region
        begin = start + block * (self.block_stride or self.page_size)
        return self.buffers[buffer][begin : begin + self.page_size]

    def padding_bytes(self) -> list[torch.Tensor]:
        """The bytes between blocks of the ``strided`` form (none for the other forms)."""
        if not self.block_stride or self.block_stride == self.page_size:
            return []
        return [buffer.view(-1, self.block_stride)[:, self.page_size :] for buffer in self.buffers]


def _backing_regions(
    kv_cache_config: Any, fill
) -> tuple[list[torch.Tensor], dict[str, tuple[int, int]]]:
    """Allocate as the installed release's model runner does.

    0.30+ (``KVCacheTensor.layers``/``layer_stride``): one buffer; layer ``l`` of a tensor
    starts at ``offset + l * layer_stride``. Earlier releases (``shared_by``): one buffer per
    KVCacheTensor, shared by the layers (one per group) listed in it.
    """
    tensors = kv_cache_config.kv_cache_tensors
    regions: dict[str, tuple[int, int]] = {}
    if hasattr(tensors[0], "layer_stride"):
        sizes = {tensor.size for tensor in tensors}
        assert len(sizes) == 1
        buffers = [fill(sizes.pop())]
        for tensor in tensors:
            for index, name in enumerate(tensor.layers):
                regions[name] = (0, tensor.offset + index * tensor.layer_stride)
        return buffers, regions
    buffers = []
    for tensor in tensors:
        buffers.append(fill(tensor.size))
        for name in tensor.shared_by:
            regions[name] = (len(buffers) - 1, 0)
    return buffers, regions


def allocate_caches(kv_cache_config: Any, form: str, ratio: int, seed: int | None) -> Caches:
    """Lay out the caches as vLLM does, with per-layer views in ``form``.

    ``form`` is logical ``[NB, PS]``, physical ``[NB*r, PS/r]``, K/V-leading
    ``[2, NB*r, PS/(2r)]``, flat bytes, or ``strided``: logical views whose blocks lie two
    pages apart (a page of padding after each, as a view into a block-interleaved buffer
    has). Buffers hold random bytes when ``seed`` is given, zeros otherwise.
    """
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def fill(size: int) -> torch.Tensor:
        if generator is None:
            return torch.zeros(size, dtype=torch.uint8)
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)

    if form == "strided":
        return _strided_caches(kv_cache_config, fill)
    buffers, regions = _backing_regions(kv_cache_config, fill)
    specs = layer_specs(kv_cache_config)
    nb = kv_cache_config.num_blocks
    views: dict[str, torch.Tensor] = {}
    pages = set()
    for name, (buffer, start) in regions.items():
        page = specs[name].page_size_bytes
        pages.add(page)
        region = buffers[buffer][start : start + nb * page]
        if form == "flat":
            views[name] = region
        elif form == "logical":
            views[name] = region.view(torch.float32).view(nb, page // 4)
        elif form == "physical":
            views[name] = region.view(torch.float32).view(nb * ratio, page // ratio // 4)
        elif form == "kv_split":  # K half, then V half, each NB*r blocks of PS/(2r) bytes
            views[name] = region.view(torch.float32).view(2, nb * ratio, page // ratio // 8)
        else:
            raise ValueError(form)
    return Caches(buffers, views, regions, max(pages))


def _strided_caches(kv_cache_config: Any, fill) -> Caches:
    """One buffer per backing region of vLLM's layout (layers of an HMA overlay still share
    it), each block followed by a page of padding; views ``[NB, PS]`` with stride 2*PS."""
    _, original = _backing_regions(kv_cache_config, lambda size: torch.empty(0))
    specs = layer_specs(kv_cache_config)
    nb = kv_cache_config.num_blocks
    pages = {specs[name].page_size_bytes for name in original}
    page = max(pages)
    if len(pages) != 1:
        raise ValueError(f"the strided form needs one page size, found {sorted(pages)}")
    buffers, by_region, regions, views = [], {}, {}, {}
    for name, region in original.items():
        if region not in by_region:
            by_region[region] = len(buffers)
            buffers.append(fill(nb * 2 * page))
        index = by_region[region]
        regions[name] = (index, 0)
        views[name] = buffers[index].view(torch.float32).view(nb, 2, page // 4)[:, 0, :]
    return Caches(buffers, views, regions, page, block_stride=2 * page)


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            specs[name] = group.kv_cache_spec
    return specs


def advertised_metadata(worker: Any) -> NixlAgentMetadata:
    """The agent metadata this worker would send a peer in the NIXL handshake."""
    payload = worker.xfer_handshake_metadata
    return msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)


def _block_descs(
    base_addrs: list[int],
    block_lens: list[int],
    block_strides: list[int],
    physical_blocks: list[int],
) -> np.ndarray:
    rows = [
        (base + block * stride, length, 0)
        for base, length, stride in zip(base_addrs, block_lens, block_strides, strict=True)
        for block in physical_blocks
    ]
    return np.array(rows, dtype=np.uint64)


def _strides(metadata: NixlAgentMetadata) -> list[int]:
    """Bytes between consecutive blocks of each region (releases before 0.30: dense blocks)."""
    return list(getattr(metadata, "block_strides", None) or metadata.block_lens)


def read_blocks(
    decode: Any, prefill: Any, logical_blocks: list[int], timeout_s: float = 30.0
) -> int:
    """NIXL READ of ``logical_blocks`` from ``prefill``'s registered caches into ``decode``'s.

    Both sides' descriptors come from what each worker advertises in the handshake
    (base addresses, block lengths and strides of the registered regions).
    Returns the bytes moved.
    """
    remote = advertised_metadata(prefill)
    local = advertised_metadata(decode)
    ratio = decode._physical_blocks_per_logical_kv_block
    physical = [b * ratio + j for b in logical_blocks for j in range(ratio)]
    agent = decode.nixl_wrapper
    remote_name = agent.add_remote_agent(remote.agent_metadata)
    src = _block_descs(remote.kv_caches_base_addr, remote.block_lens, _strides(remote), physical)
    dst = _block_descs(local.kv_caches_base_addr, local.block_lens, _strides(local), physical)
    src_descs = agent.get_xfer_descs(src, "DRAM")
    dst_descs = agent.get_xfer_descs(dst, "DRAM")
    handle = agent.initialize_xfer("READ", dst_descs, src_descs, remote_name)
    try:
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"NIXL READ ended in state {state}")
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
    finally:
        agent.release_xfer_handle(handle)
        agent.remove_remote_agent(remote_name)
    return int(dst[:, 1].sum())
