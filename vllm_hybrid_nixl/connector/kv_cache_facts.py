"""Read a :class:`~vllm_hybrid_nixl.protocol.fingerprint.LayoutFingerprint` out of vLLM's objects.

Used by the worker at registration (from the live engine) and by ``check`` (from the
configuration vLLM computes for the given engine arguments), so both produce the same
fingerprint for the same settings. :func:`describe_cache` turns one cache tensor into the
layout check's plain description.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.protocol.fingerprint import GroupFingerprint, LayoutFingerprint
from vllm_hybrid_nixl.protocol.layout import LayerDescription

MAMBA_KINDS = ("mamba",)


def describe_cache(name: str, cache: Any, **spec: Any) -> LayerDescription:
    """The layout check's description of layer ``name``'s cache tensor: its geometry and
    storage read from the tensor, its spec facts (kind, type, group, blocks, ratio, page,
    state bytes) as given."""
    storage = cache.untyped_storage()
    return LayerDescription(
        name=name,
        shape=tuple(cache.shape),
        stride=tuple(cache.stride()),
        element_size=cache.element_size(),
        dtype=str(cache.dtype).removeprefix("torch."),
        data_ptr=cache.data_ptr(),
        storage_ptr=storage.data_ptr(),
        storage_nbytes=storage.nbytes(),
        **spec,
    )


def spec_kind(spec: Any) -> str:
    """Map a vLLM KV-cache spec to the kind names of the layout check."""
    classes = compat.kv_cache_spec_classes()
    for kind in ("mamba", "sliding_window_mla", "mla", "sliding_window", "chunked_local"):
        cls = classes.get(kind)
        if cls is not None and isinstance(spec, cls):
            return "mla" if kind == "sliding_window_mla" else kind
    if isinstance(spec, classes["full_attention"]):
        return "full_attention"
    return type(spec).__name__


def representative_spec(spec: Any) -> Any:
    """A group's spec, unwrapped when vLLM wraps several same-type specs in one."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    if per_layer:
        return next(iter(per_layer.values()))
    return spec


def state_bytes(spec: Any) -> int:
    """Bytes of a Mamba spec's state tensors (its page without padding); 0 when unknown."""
    return sum(
        math.prod(int(size) for size in shape) * int(getattr(dtype, "itemsize", 0))
        for shape, dtype in zip(
            getattr(spec, "shapes", ()), getattr(spec, "dtypes", ()), strict=False
        )
    )


def mamba_state(spec: Any) -> str:
    """What a Mamba group's state is made of: its kind, and each state tensor's shape and
    dtype (the conv-state layout shows in the shapes)."""
    kind = str(getattr(spec, "mamba_type", "mamba")).rsplit(".", 1)[-1].lower()
    shapes = "+".join(
        "(" + ",".join(str(d) for d in shape) + ")" for shape in getattr(spec, "shapes", ())
    )
    dtypes = "+".join(str(d).removeprefix("torch.") for d in getattr(spec, "dtypes", ()))
    return f"{kind} {shapes} {dtypes}"


def group_fingerprints(
    kv_cache_config: Any, kernel_block_size: int
) -> tuple[GroupFingerprint, ...]:
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = representative_spec(group.kv_cache_spec)
        kind = spec_kind(spec)
        block_size = int(spec.block_size)
        if kind in MAMBA_KINDS or block_size % kernel_block_size:
            kernel, ratio = block_size, 1
        else:
            kernel, ratio = kernel_block_size, block_size // kernel_block_size
        window = getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None
        )
        groups.append(
            GroupFingerprint(
                state=mamba_state(spec) if kind in MAMBA_KINDS else "",
                kind=kind,
                num_layers=len(group.layer_names),
                block_size=block_size,
                kernel_block_size=kernel,
                ratio=ratio,
                page_bytes=int(group.kv_cache_spec.page_size_bytes),
                sliding_window=int(window) if window else None,
                dtype=str(getattr(spec, "dtype", "")).removeprefix("torch."),
            )
        )
    return tuple(groups)


def fingerprint_of(
    vllm_config: Any,
    kv_cache_config: Any,
    *,
    kernel_block_size: int,
    attn_backend: str,
    kv_layout: str,
    transfer_mode: str,
    vllm_compat_hash: str,
) -> LayoutFingerprint:
    model = vllm_config.model_config
    installed = compat.installed_vllm()
    groups = group_fingerprints(kv_cache_config, kernel_block_size)
    # vLLM's NIXL supports heterogeneous TP for single-group models (it maps KV heads across
    # ranks) and compares handshake strings exactly: for those, TP and the per-rank page size
    # are not part of the layout (0); total KV heads, head size, dtypes and block size are.
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if len(groups) <= 1:
        tp = 0
        groups = tuple(dataclasses.replace(group, page_bytes=0) for group in groups)
    return LayoutFingerprint(
        vllm_version=str(installed.version) if installed else "unknown",
        transfer_mode=transfer_mode,
        model=str(model.model),
        dtype=str(model.dtype).removeprefix("torch."),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        num_hidden_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
        tensor_parallel_size=tp,
        kv_layout=str(kv_layout),
        attn_backend=str(attn_backend),
        hybrid_kv_cache_manager=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        groups=groups,
        vllm_compat_hash=vllm_compat_hash,
    )
