"""NIXL workers whose ``register_kv_caches`` understands the hybrid memory allocator.

``register_kv_caches`` = describe every layer (plain data) -> run the HMA-aware
layout check (:mod:`vllm_hybrid_nixl.layout`) -> hand vLLM's own registration
block-major ``[NB*r, PS/r]`` views of the validated tensors, the one form every
supported release registers byte-correctly.  Registration itself stays vLLM's.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from vllm_hybrid_nixl import compat
from vllm_hybrid_nixl.layout import (
    MAMBA_KIND,
    LayerDescription,
    ValidatedLayer,
    check_layout,
)

# A child of the "vllm" logger, so vLLM's log handlers and level apply in every process.
logger = logging.getLogger("vllm.hybrid_nixl.worker")

_NIXL = compat.nixl_classes()


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


def _layer_specs_and_groups(kv_cache_config: Any) -> dict[str, tuple[Any, int]]:
    """Layer name -> (its own KV-cache spec, its transfer group index)."""
    groups = getattr(kv_cache_config, "transfer_groups", None) or kv_cache_config.kv_cache_groups
    result: dict[str, tuple[Any, int]] = {}
    for group_id, group in enumerate(groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            result[name] = (per_layer.get(name, group.kv_cache_spec), group_id)
    return result


def describe_layers(
    kv_caches: dict[str, torch.Tensor], kv_cache_config: Any, ratio: int
) -> list[LayerDescription]:
    """Describe every layer that has a KV-cache spec, as plain data for the check."""
    specs = _layer_specs_and_groups(kv_cache_config)
    # Groups share one spec object; classify each spec once (256-layer models add up).
    spec_facts: dict[int, tuple[str, str, int]] = {}
    num_blocks = int(kv_cache_config.num_blocks)
    layers = []
    for name, cache in kv_caches.items():
        if name not in specs:
            continue  # no spec: the layer reuses another layer's cache
        spec, group_id = specs[name]
        facts = spec_facts.get(id(spec))
        if facts is None:
            facts = (spec_kind(spec), type(spec).__name__, int(spec.page_size_bytes))
            spec_facts[id(spec)] = facts
        kind, spec_type, page_size = facts
        storage = cache.untyped_storage()
        layers.append(
            LayerDescription(
                name=name,
                spec_kind=kind,
                spec_type=spec_type,
                group_id=group_id,
                num_blocks=num_blocks,
                ratio=ratio,
                page_size=page_size,
                shape=tuple(cache.shape),
                stride=tuple(cache.stride()),
                element_size=cache.element_size(),
                dtype=str(cache.dtype).removeprefix("torch."),
                data_ptr=cache.data_ptr(),
                storage_ptr=storage.data_ptr(),
                storage_nbytes=storage.nbytes(),
            )
        )
    return layers


def physical_view(cache: torch.Tensor, validated: ValidatedLayer) -> torch.Tensor:
    """The same bytes as ``[blocks, page]`` rows: ``[NB*r, PS/r]``, or ``[NB, PS]`` for Mamba."""
    layer = validated.layer
    page = validated.physical_page_size
    blocks = layer.num_blocks if layer.spec_kind == MAMBA_KIND else layer.num_blocks * layer.ratio
    if page % cache.element_size() == 0:
        row = page // cache.element_size()
        return torch.as_strided(cache, (blocks, row), (row, 1))
    offset = cache.data_ptr() - cache.untyped_storage().data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), offset, (blocks, page), (page, 1)
    )


class HybridRegistrationMixin:
    """Overrides ``register_kv_caches`` of a vLLM NIXL worker with describe -> check -> register."""

    kv_cache_config: Any
    _physical_blocks_per_logical_kv_block: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # On CPU, vLLM's NIXL worker pins the calling thread to the last core of each NUMA
        # node "for KV transfer"; that thread is the engine's compute thread, so every engine
        # on a box ends up computing on the same core. Keep the binding the engine chose.
        affinity = os.sched_getaffinity(0)
        super().__init__(*args, **kwargs)
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
            logger.info(
                "vllm-hybrid-nixl: kept the compute thread on cores %s (vLLM's NIXL worker "
                "had moved it to the KV-transfer core)",
                sorted(affinity),
            )

    #: Seconds spent describing and checking in the last ``register_kv_caches``.
    layout_check_seconds: float = 0.0
    validated_layers: list[ValidatedLayer]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
        layers = describe_layers(kv_caches, self.kv_cache_config, ratio)
        self.validated_layers = check_layout(layers)
        views = {
            item.layer.name: item for item in self.validated_layers if item.needs_physical_view
        }
        for_registration = {
            name: physical_view(cache, views[name]) if name in views else cache
            for name, cache in kv_caches.items()
        }
        self.layout_check_seconds = time.perf_counter() - started
        forms = sorted({item.form.value for item in self.validated_layers})
        logger.info(
            "vllm-hybrid-nixl: %s (pid %d) validated %d KV-cache layers (r=%d, forms=%s, "
            "groups=%d) in %.2f ms",
            type(self).__name__,
            os.getpid(),
            len(self.validated_layers),
            ratio,
            ",".join(forms) or "-",
            len({item.layer.group_id for item in self.validated_layers}),
            self.layout_check_seconds * 1e3,
        )
        super().register_kv_caches(for_registration)  # type: ignore[misc]


class HybridNixlPullWorker(HybridRegistrationMixin, _NIXL.pull_worker):
    """Pull-mode (READ) NIXL worker with the HMA-aware registration."""


class HybridNixlPushWorker(HybridRegistrationMixin, _NIXL.push_worker):
    """Push-mode (WRITE) NIXL worker with the HMA-aware registration."""
