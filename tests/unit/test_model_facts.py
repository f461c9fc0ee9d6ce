"""Which models our launchers treat as Mamba hybrids, from their config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid_nixl.protocol.model_facts import keeps_mamba_state

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("config", "mamba"),
    [
        ({"model_type": "nemotron_h"}, True),
        ({"model_type": "granitemoehybrid"}, True),
        ({"model_type": "llama", "layer_types": ["linear_attention", "full_attention"]}, True),
        ({"model_type": "x", "layers_block_type": ["mamba", "attention"]}, True),
        ({"model_type": "x", "hybrid_override_pattern": "M*M*"}, True),
        ({"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]}, False),
        ({"model_type": "gemma3_text"}, False),
    ],
)
def test_mamba_hybrids_are_recognised(tmp_path: Path, config: dict, mamba: bool) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert keeps_mamba_state(str(tmp_path)) is mamba


def test_a_hub_id_or_a_broken_config_is_not_guessed(tmp_path: Path) -> None:
    assert keeps_mamba_state("org/some-model") is False
    (tmp_path / "config.json").write_text("{not json")
    assert keeps_mamba_state(str(tmp_path)) is False


@pytest.mark.cpu_build
def test_the_launcher_sets_mamba_defaults_unless_the_arguments_decide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit VLLM_SSM_CONV_STATE_LAYOUT in the environment wins (vLLM's CPU platform
    itself writes SD into its process environment on AVX512-BF16 machines when the connector
    is not one of vLLM's own names): here there is none."""
    from vllm_hybrid_nixl.deploy.engines import EngineSpec

    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h"}))
    spec = EngineSpec(model=str(tmp_path), port=8000)
    assert spec.environment()["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    assert spec.command()[-1] == "--no-enable-prefix-caching"  # vLLM's CPU build here
    chosen = EngineSpec(model=str(tmp_path), port=8000, extra_args=["--enable-prefix-caching"])
    assert chosen.command().count("--no-enable-prefix-caching") == 0
