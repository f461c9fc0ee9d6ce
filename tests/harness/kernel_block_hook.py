"""Run real ``vllm serve`` engines on kernel blocks smaller than the user's block size.

``kernel_block_site/sitecustomize.py`` (imported by every Python process that has that
directory first on ``PYTHONPATH``) makes vLLM's CPU attention backend report one fixed kernel
block size, as a GPU kernel would; vLLM then splits each ``--block-size`` block into
r = block_size / kernel_block_size kernel blocks everywhere (block tables, cache views, NIXL
descriptors). Test-only: this directory is not part of the wheel.
"""

from __future__ import annotations

import os
from pathlib import Path

HOOK_DIR = Path(__file__).with_name("kernel_block_site")
SIZE_VARIABLE = "VLLM_HYBRID_NIXL_TEST_KERNEL_BLOCK_SIZE"
#: What the hook prints in each process it patched (engine logs).
HOOK_LINE = "vllm-hybrid-nixl test hook: CPU attention kernel block size"


def engine_env(kernel_block_size: int) -> dict[str, str]:
    """The environment an engine needs to run on ``kernel_block_size``-token kernel blocks."""
    path = [str(HOOK_DIR), os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(part for part in path if part),
        SIZE_VARIABLE: str(kernel_block_size),
    }
