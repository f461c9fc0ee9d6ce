"""What a model's ``config.json`` says that our launchers must act on (no vLLM import)."""

from __future__ import annotations

import json
from pathlib import Path

#: The variable that sets vLLM's Mamba conv-state layout, and the one layout vLLM's NIXL
#: worker can move.
CONV_LAYOUT_VARIABLE = "VLLM_SSM_CONV_STATE_LAYOUT"
NIXL_CONV_LAYOUT = "DS"

#: ``model_type`` values of hybrids whose layers keep Mamba / linear-attention state.
MAMBA_MODEL_TYPES = {
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "bamba",
    "falcon_h1",
    "jamba",
    "zamba2",
    "mamba",
    "mamba2",
    "plamo2",
    "lfm2",
    "minimax",
    "kimi_linear",
}


def keeps_mamba_state(model: str) -> bool:
    """Whether the (local) model has Mamba or linear-attention layers; False for a hub id
    or a directory without a readable config.json."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if str(config.get("model_type", "")) in MAMBA_MODEL_TYPES:
        return True
    kinds = [*(config.get("layer_types") or ()), *(config.get("layers_block_type") or ())]
    if any(k in ("mamba", "linear_attention") for k in kinds):
        return True
    return "M" in str(config.get("hybrid_override_pattern", ""))
