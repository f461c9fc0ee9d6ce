"""Refuse, at engine start-up, Mamba configurations that vLLM would accept and then die on.

vLLM 0.32's CPU build kills the engine core at the first prompt longer than one block when
a Mamba2 model runs with prefix caching (``mamba_cache_mode`` "align", vLLM's default with
prefix caching): its CPU scan returns only each sequence's final state, and the align path
indexes per-chunk states (``IndexError`` in ``mamba_mixer2.conv_ssm_forward``). It happens
with or without a KV connector; P/D makes it certain because both engines need an explicit
``--block-size``. Our connector refuses the combination when the engine starts, naming the
flag, instead of letting the first request kill the engine.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid_nixl.connector import compat


class UnservableMambaConfigError(ValueError):
    """A Mamba configuration that would kill the engine at its first request."""


def has_mamba_layers(kv_cache_config: Any) -> bool:
    if kv_cache_config is None:
        return False
    found = getattr(kv_cache_config, "has_mamba_layers", None)
    if found is not None:
        return bool(found)
    mamba = compat.kv_cache_spec_classes().get("mamba")
    return mamba is not None and any(
        isinstance(group.kv_cache_spec, mamba) for group in kv_cache_config.kv_cache_groups
    )


def refuse_unservable_mamba(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise :class:`UnservableMambaConfigError` for CPU + Mamba + prefix-caching align mode."""
    if not has_mamba_layers(kv_cache_config) or not compat.on_cpu_platform():
        return
    cache = vllm_config.cache_config
    mode = str(getattr(cache, "mamba_cache_mode", "none"))
    if mode != "none" or bool(getattr(cache, "enable_prefix_caching", False)):
        raise UnservableMambaConfigError(
            f"vllm-hybrid-nixl refuses to start this engine: the model has Mamba layers and "
            f"prefix caching is on (mamba_cache_mode={mode!r}), and vLLM's CPU build kills the "
            "engine core at the first prompt longer than one block in that mode (IndexError in "
            "mamba_mixer2.conv_ssm_forward). What to change: start both engines with "
            "--no-enable-prefix-caching (vllm-hybrid-nixl's launchers do this for Mamba models)."
        )
