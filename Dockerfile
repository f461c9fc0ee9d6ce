# vllm-hybrid-nixl on top of the official vLLM OpenAI image (GPU). First version: the image
# cannot be built on our CI machines (no Docker engine, no registry); everything it runs is
# the same install script the README and CI use.
#
#   docker build -t vllm-hybrid-nixl .
#   docker run --gpus all --ipc=host -p 8100:8100 -e VLLM_NIXL_SIDE_CHANNEL_HOST=<node ip> \
#     vllm-hybrid-nixl MODEL --config /opt/vllm-hybrid-nixl/configs/prefill-gpu.yaml
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/vllm-hybrid-nixl
COPY setup.py pyproject.toml README.md ./
COPY vllm_hybrid_nixl ./vllm_hybrid_nixl
COPY scripts ./scripts
COPY configs ./configs

# Installs into the image's own Python; the image's vLLM satisfies the [cuda] extra.
RUN VENV=system VLLM_FLAVOR=cuda PYTHON=python3 bash scripts/install.sh

# The base image's entrypoint (`vllm serve`) loads our plugin by its entry point, so
# --kv-transfer-config '{"kv_connector":"HybridNixlConnector",...}' works unchanged.
