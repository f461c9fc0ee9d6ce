"""The tiny model builder: byte-identical per seed, and each architecture forms the KV-cache
groups we expect in vLLM (real VllmConfig, real model construction, real KVCacheConfig)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.integration


def digest(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    spec = TinyModelSpec(arch="gemma3", layers=3, hidden=64, heads=2, kv_heads=1, seed=5)
    first = digest(build_tiny_model(tmp_path / "a", spec))
    second = digest(build_tiny_model(tmp_path / "b", spec))
    other = digest(build_tiny_model(tmp_path / "c", TinyModelSpec(**{**spec.__dict__, "seed": 6})))
    assert first == second
    assert first["model.safetensors"] != other["model.safetensors"]


@pytest.mark.parametrize(
    ("arch", "groups"),
    [
        ("llama", {"FullAttentionSpec"}),
        ("llama-hybrid", {"FullAttentionSpec", "SlidingWindowSpec"}),
        ("gemma3", {"FullAttentionSpec", "SlidingWindowSpec"}),
    ],
)
def test_each_arch_builds_in_vllm_with_its_kv_cache_groups(
    tmp_path: Path, arch: str, groups: set[str]
) -> None:
    from vllm_hybrid_nixl.testing import worker_harness as harness

    model = build_tiny_model(
        tmp_path / arch, TinyModelSpec(arch=arch, layers=6, hidden=64, heads=2, kv_heads=1)
    )
    with harness.model_setup(str(model)) as setup:
        found = {type(g.kv_cache_spec).__name__ for g in setup.kv_cache_config.kv_cache_groups}
        layers = sum(len(g.layer_names) for g in setup.kv_cache_config.kv_cache_groups)
    assert found == groups
    assert layers == 6
