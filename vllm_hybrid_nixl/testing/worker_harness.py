"""Build real vLLM NIXL workers in this process and move real bytes between them.

The VllmConfig and KVCacheConfig are the ones vLLM computes for the tiny hybrid model
(EngineArgs -> VllmConfig, the model's own attention layers -> KV-cache specs ->
``get_kv_cache_configs``).  Caches are allocated the way vLLM's hybrid allocator does:
one raw byte tensor per ``KVCacheTensor``, shared by the layers listed in it, viewed
per layer in the layout under test.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_hybrid_nixl.launcher import install_cpu_version_alias
from vllm_hybrid_nixl.netutil import free_port

install_cpu_version_alias()

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    get_current_attn_backends,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # noqa: E402

BLOCK_SIZE = 128  # user block size; r = 128 / kernel block size
KV_CACHE_BYTES = 8 << 20


@dataclass
class ModelSetup:
    vllm_config: Any
    kv_cache_config: Any


@contextlib.contextmanager
def model_setup(model_dir: str, kv_cache_bytes: int = KV_CACHE_BYTES) -> Iterator[ModelSetup]:
    """Real VllmConfig + KVCacheConfig for ``model_dir``, with vLLM's distributed state up."""
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.model_loader.utils import initialize_model

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
    vllm_config = engine_args.create_engine_config()
    affinity = os.sched_getaffinity(0)  # the NIXL worker pins the process on CPU
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        try:
            with torch.device("cpu"):
                initialize_model(vllm_config=vllm_config)  # registers the attention layers
            layers = vllm_config.compilation_config.static_forward_context
            specs = {
                name: layer.get_kv_cache_spec(vllm_config)
                for name, layer in layers.items()
                if isinstance(layer, AttentionLayerBase)
            }
            # What the engine core does before sizing the cache: resolve one layout.
            backends = get_current_attn_backends(vllm_config)
            supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
            resolve_kv_cache_layout(vllm_config, [supported], specs.values())
            kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [kv_cache_bytes])[0]
            yield ModelSetup(vllm_config, kv_cache_config)
        finally:
            os.sched_setaffinity(0, affinity)
            cleanup_dist_env_and_memory()


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
    """One backing buffer and the per-layer views vLLM's registration receives."""

    raw: torch.Tensor
    views: dict[str, torch.Tensor]
    layer_offsets: dict[str, int]  # byte offset of each layer's block 0 in ``raw``
    page_size: int


def allocate_caches(kv_cache_config: Any, form: str, ratio: int, seed: int | None) -> Caches:
    """Lay out the caches as vLLM 0.32 does, with per-layer views in ``form``.

    One backing buffer; layer ``l`` of a KVCacheTensor starts at
    ``offset + l * layer_stride`` and groups overlay each other.  ``form`` is
    logical ``[NB, PS]``, physical ``[NB*r, PS/r]`` or flat bytes.  The buffer holds
    random bytes when ``seed`` is given, zeros otherwise.
    """
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
    assert len(sizes) == 1
    size = sizes.pop()
    if seed is None:
        raw = torch.zeros(size, dtype=torch.uint8)
    else:
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    specs = layer_specs(kv_cache_config)
    nb = kv_cache_config.num_blocks
    views: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    pages = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            page = specs[name].page_size_bytes
            pages.add(page)
            start = tensor.offset + index * tensor.layer_stride
            offsets[name] = start
            region = raw[start : start + nb * page]
            if form == "flat":
                views[name] = region
            elif form == "logical":
                views[name] = region.view(torch.float32).view(nb, page // 4)
            elif form == "physical":
                views[name] = region.view(torch.float32).view(nb * ratio, page // ratio // 4)
            else:
                raise ValueError(form)
    return Caches(raw, views, offsets, max(pages))


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
    src = _block_descs(
        remote.kv_caches_base_addr, remote.block_lens, remote.block_strides, physical
    )
    dst = _block_descs(local.kv_caches_base_addr, local.block_lens, local.block_strides, physical)
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
