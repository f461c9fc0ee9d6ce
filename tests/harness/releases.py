"""Facts about the installed vLLM release that the tests' expectations depend on."""

from __future__ import annotations

from vllm_hybrid_nixl.connector import compat

#: What vLLM 0.24-0.25's NIXL worker raises when it refuses a cache.
STOCK_REFUSAL = "All kv cache tensors must have the same number of blocks"


def stock_is_strict() -> bool:
    """vLLM 0.24-0.25: the stock registration demands shape[0] == NB*r of every region, and
    takes dim 0 of a non-5-D cache as K/V, so it cannot register vLLM's own CPU caches."""
    installed = compat.installed_vllm()
    return installed is not None and installed.base_block_check is compat.BaseBlockCheck.STRICT
