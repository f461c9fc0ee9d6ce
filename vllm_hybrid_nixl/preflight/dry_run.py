"""vLLM's KV-cache configuration for some engine arguments, without starting an engine.

EngineArgs -> VllmConfig; the model is built on PyTorch's ``meta`` device (no weights,
no memory) only so that its attention layers report their KV-cache specs; then vLLM's
own KV-cache planning (``compat.kv_cache_config_for``) groups them exactly as the engine would.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
                model = initialize_model(vllm_config=vllm_config)  # registers the layers
            layers = vllm_config.compilation_config.static_forward_context
            specs = {
                name: layer.get_kv_cache_spec(vllm_config)
                for name, layer in layers.items()
                if isinstance(layer, AttentionLayerBase)
            }
            specs = {name: spec for name, spec in specs.items() if spec is not None}
            specs = as_each_rank_holds_them(vllm_config, type(model), specs)
            # What the engine core does before sizing the cache: resolve one layout.
            backends = get_current_attn_backends(vllm_config)
            compat.resolve_kv_cache_layout(vllm_config, backends, specs.values())
            kv_cache_config = compat.kv_cache_config_for(vllm_config, specs, kv_cache_bytes)
            yield KvCacheSetup(vllm_config, kv_cache_config, backends, specs)
        finally:
            os.sched_setaffinity(0, affinity)
            cleanup_dist_env_and_memory()


def as_each_rank_holds_them(vllm_config: Any, model_cls: type, specs: dict[str, Any]) -> dict:
    """The dry run builds the model at TP 1 (one process); an engine at TP n holds per-rank
    KV heads and Mamba state shapes. Rescale the specs as vLLM's layers would at TP n: KV heads
    per layer as vLLM's attention layers split them, Mamba state shapes from the model class's
    TP-aware shape function (the padded page and block size already come from TP n)."""
    parallel_config = vllm_config.parallel_config
    if int(parallel_config.tensor_parallel_size) == 1:
        return specs
    tp = int(parallel_config.tensor_parallel_size)
    shapes_of = getattr(model_cls, "get_mamba_state_shape_from_config", None)
    mamba_shapes = None
    scaled = {}
    for name, spec in specs.items():
        if hasattr(spec, "num_kv_heads"):
            # each layer's own head count (models may vary it per layer), split as vLLM's
            # attention layers split it: replicated once TP exceeds the heads
            spec = dataclasses.replace(spec, num_kv_heads=max(1, int(spec.num_kv_heads) // tp))
        elif hasattr(spec, "shapes") and shapes_of is not None and not _replicated(spec):
            if mamba_shapes is None:
                mamba_shapes = tuple(tuple(int(d) for d in s) for s in shapes_of(vllm_config))
            if len(mamba_shapes) < len(spec.shapes):
                raise ValueError(
                    f"{model_cls.__name__} reports {len(mamba_shapes)} state shapes at "
                    f"TP {parallel_config.tensor_parallel_size}, its layer {name} "
                    f"{len(spec.shapes)}; check cannot predict this model's per-rank state"
                )
            spec = dataclasses.replace(spec, shapes=mamba_shapes[: len(spec.shapes)])
        scaled[name] = spec
    return scaled


def _replicated(spec: Any) -> bool:
    """A state every rank holds whole (vLLM's ``MambaSpec.tp_replicated``): not rescaled."""
    return bool(getattr(spec, "tp_replicated", False))
