# vllm-hybrid-nixl on the official vLLM OpenAI image (GPU). One image for every role:
#
#   docker build -t vllm-hybrid-nixl .
#   docker run --gpus all --ipc=host -p 8100:8100 vllm-hybrid-nixl --model M --port 8100 \
#     --kv-transfer-config '{"kv_connector":"HybridNixlConnector","kv_role":"kv_producer"}'
#   docker run -p 8000:8000 vllm-hybrid-nixl router --port 8000 --prefill http://P:8100 ...
#
# Engines and router bind the container's own address and advertise the NIXL side channel
# on it (vllm_hybrid_nixl/deploy/container.py). The install step is scripts/install.sh, the script
# the README and CI use. The build stops if the image's vLLM is outside our supported range
# or its NIXL is older than 1.5 (`container check-image`).
#
# VLLM_VERSION defaults to the newest tested release (vllm_hybrid_nixl/common/releases.py;
# a test holds the two equal); `--build-arg VLLM_VERSION=0.32.0` builds on another one, and
# VLLM_IMAGE replaces the base image altogether.
ARG VLLM_VERSION=0.34.0
ARG VLLM_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}
FROM ${VLLM_IMAGE}

WORKDIR /opt/vllm-hybrid-nixl
COPY setup.py pyproject.toml README.md ./
COPY vllm_hybrid_nixl ./vllm_hybrid_nixl
COPY scripts ./scripts
COPY configs ./configs

# Into the image's own Python; its vLLM satisfies the [cuda] extra.
RUN VENV=system VLLM_FLAVOR=cuda PYTHON=python3 PIP_NO_CACHE_DIR=1 bash scripts/install.sh \
    && python3 -m vllm_hybrid_nixl.deploy.container check-image

ENV HF_HUB_OFFLINE=0 \
    VLLM_NIXL_SIDE_CHANNEL_PORT=5600
EXPOSE 8000 8100 5600
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-m", "vllm_hybrid_nixl.deploy.container", "health", "8100"]
ENTRYPOINT ["python3", "-m", "vllm_hybrid_nixl.deploy.container"]
