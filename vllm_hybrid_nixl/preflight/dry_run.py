"""vLLM's KV-cache configuration for some engine arguments, without starting an engine.

EngineArgs -> VllmConfig; the model is built on PyTorch's ``meta`` device (no weights,
no memory) only so that its attention layers report their KV-cache specs; then vLLM's
own KV-cache planning (``compat.kv_cache_config_for``) groups them exactly as the engine would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

#: Bytes offered to vLLM's KV-cache sizing; only the number of blocks depends on it.
DRY_RUN_KV_CACHE_BYTES = 1 << 30


@dataclass
class KvCacheSetup:
    vllm_config: Any
    kv_cache_config: Any
    attn_backends: list[Any]
    specs: dict[str, Any]


@contextlib.contextmanager
def kv_cache_setup(
    engine_args: Any, kv_cache_bytes: int = DRY_RUN_KV_CACHE_BYTES, device: str = "meta"
) -> Iterator[KvCacheSetup]:
    """Yield vLLM's configuration for ``engine_args`` with vLLM's distributed state up."""
    install_cpu_version_alias()
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.parallel_state import (
        cleanup_dist_env_and_memory,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model

    from vllm_hybrid_nixl.connector import compat

    vllm_config = engine_args.create_engine_config()
    affinity = os.sched_getaffinity(0)  # vLLM's NIXL worker pins the process on CPU
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
            with torch.device(device):
                initialize_model(vllm_config=vllm_config)  # registers the attention layers
            layers = vllm_config.compilation_config.static_forward_context
            specs = {
                name: layer.get_kv_cache_spec(vllm_config)
                for name, layer in layers.items()
                if isinstance(layer, AttentionLayerBase)
            }
            specs = {name: spec for name, spec in specs.items() if spec is not None}
            # What the engine core does before sizing the cache: resolve one layout.
            backends = get_current_attn_backends(vllm_config)
            compat.resolve_kv_cache_layout(vllm_config, backends, specs.values())
            kv_cache_config = compat.kv_cache_config_for(vllm_config, specs, kv_cache_bytes)
            yield KvCacheSetup(vllm_config, kv_cache_config, backends, specs)
        finally:
            os.sched_setaffinity(0, affinity)
            cleanup_dist_env_and_memory()
