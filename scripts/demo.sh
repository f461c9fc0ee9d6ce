#!/usr/bin/env bash
# The main job on this machine: set up .venv, then serve one request through a prefill and a
# decode engine (HybridNixlConnector, tiny local hybrid model). Extra arguments go to
# `vllm-hybrid-nixl demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/vllm-hybrid-nixl demo "$@"
