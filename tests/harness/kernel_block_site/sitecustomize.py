"""Test-only: make vLLM's CPU attention backend report one fixed kernel block size in every
Python process that starts with this directory first on ``PYTHONPATH`` (the API server,
the engine core, its workers: spawned or forked).

On CPU the backend accepts any multiple of 16 or 32, so vLLM always runs r = 1; a GPU kernel
with a smaller fixed block size gives r = block_size / kernel_block_size. With
``VLLM_HYBRID_NIXL_TEST_KERNEL_BLOCK_SIZE=32`` and ``--block-size 64`` the CPU kernel really
computes attention on 32-token blocks (r = 2) and vLLM's own block tables, cache views and
NIXL descriptors follow. This is the one thing faked, because the real case needs a GPU
kernel. Never shipped: it lives in ``tests/harness``, outside the wheel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "vllm.v1.attention.backends.cpu_attn"
SIZE = os.environ.get("VLLM_HYBRID_NIXL_TEST_KERNEL_BLOCK_SIZE")


def _fixed_sizes(kernel_block_size: int):
    def get_supported_kernel_block_sizes(*_args, **_kwargs) -> list[int]:
        return [kernel_block_size]

    return staticmethod(get_supported_kernel_block_sizes)


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` through the other finders and patches its backend once executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            module.CPUAttentionBackend.get_supported_kernel_block_sizes = _fixed_sizes(int(SIZE))
            print(
                f"vllm-hybrid-nixl test hook: CPU attention kernel block size {SIZE} "
                f"(pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if SIZE:
    sys.meta_path.insert(0, _PatchAfterLoad())
