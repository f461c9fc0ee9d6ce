"""Session-wide fixtures: tiny local models, built once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama mixing sliding-window and full attention (2 KV-cache groups)."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hybrid"), TinyModelSpec())
