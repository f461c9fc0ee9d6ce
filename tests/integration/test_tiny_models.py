"""The tiny model builder: byte-identical per seed, and each architecture forms the KV-cache
groups we expect in vLLM (real VllmConfig, real model construction, real KVCacheConfig)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from vllm_hybrid_nixl.tools.tiny_model import OutputDirError, TinyModelSpec, build_tiny_model

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
    from tests.harness import worker_harness as harness

    model = build_tiny_model(
        tmp_path / arch, TinyModelSpec(arch=arch, layers=6, hidden=64, heads=2, kv_heads=1)
    )
    with harness.model_setup(str(model)) as setup:
        found = {type(g.kv_cache_spec).__name__ for g in setup.kv_cache_config.kv_cache_groups}
        layers = sum(len(g.layer_names) for g in setup.kv_cache_config.kv_cache_groups)
    assert found == groups
    assert layers == 6


SMALL = TinyModelSpec(layers=2, hidden=32, heads=2, kv_heads=1)


def test_a_non_empty_directory_is_kept_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="not empty.*--overwrite"):
        build_tiny_model(out, SMALL)
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging left behind
    build_tiny_model(out, SMALL, overwrite=True)
    assert (out / "config.json").is_file() and not (out / "precious.txt").exists()


def test_links_and_files_are_refused_and_nothing_is_written_through_them(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(OutputDirError, match="symbolic link"):
        build_tiny_model(link, SMALL, overwrite=True)
    assert not any(elsewhere.iterdir())
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OutputDirError, match="not a directory"):
        build_tiny_model(a_file, SMALL)
    assert a_file.read_text() == "x"
