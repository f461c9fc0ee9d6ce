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
# VLLM_IMAGE replaces the base image altogether. VLLM_FLAVOR=cpu installs against a base
# whose vLLM is the CPU build (how CI builds this file without a GPU base: docs/deploy.md).
# Behind a TLS-inspecting proxy or a private index, give pip its settings as build secrets:
#   --secret id=pip_conf,src=/etc/pip.conf --secret id=ca_bundle,src=/path/to/ca-bundle.crt
ARG VLLM_VERSION=0.34.0
ARG VLLM_IMAGE=vllm/vllm-openai:v${VLLM_VERSION}
FROM ${VLLM_IMAGE}

ARG VLLM_FLAVOR=cuda

WORKDIR /opt/vllm-hybrid-nixl
COPY setup.py pyproject.toml README.md ./
COPY vllm_hybrid_nixl ./vllm_hybrid_nixl
COPY scripts ./scripts
COPY configs ./configs

# Into the image's own Python; its vLLM satisfies the [cuda] extra.
RUN --mount=type=secret,id=pip_conf,target=/run/secrets/pip_conf \
    --mount=type=secret,id=ca_bundle,target=/run/secrets/ca_bundle \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi \
    && if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && VENV=system VLLM_FLAVOR=${VLLM_FLAVOR} PYTHON=python3 PIP_NO_CACHE_DIR=1 \
        INSTALL_LOG=/tmp/install.log bash scripts/install.sh \
    && rm -f /tmp/install.log \
    && python3 -m vllm_hybrid_nixl.deploy.container check-image

ENV HF_HUB_OFFLINE=0 \
    VLLM_NIXL_SIDE_CHANNEL_PORT=5600
EXPOSE 8000 8100 5600
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-m", "vllm_hybrid_nixl.deploy.container", "health", "8100"]
ENTRYPOINT ["python3", "-m", "vllm_hybrid_nixl.deploy.container"]
