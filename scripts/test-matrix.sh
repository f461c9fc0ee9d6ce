#!/usr/bin/env bash
# Run the version-sensitive tests against every vLLM release of the matrix, each in its own
# virtual environment, and regenerate the results table in docs/versions.md.
#
#   scripts/test-matrix.sh                 every release in MATRIX_RELEASES
#   MATRIX_RELEASES="0.27.1" scripts/test-matrix.sh
#   MATRIX_RELEASES=0.25.1 MATRIX_TESTS=tests/e2e/x.py MATRIX_RERUN=x scripts/test-matrix.sh
#                                          rerun some tests; their results replace the old ones
#
# 0.32.0 (the newest CPU build) runs in .venv, made by scripts/install.sh (the default test
# command's environment); older releases get .venvs/vllm-<release> (scripts/matrix-env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# The releases come from the one list (vllm_hybrid_nixl/common/releases.py).
# shellcheck source=scripts/releases.sh
source scripts/releases.sh
RELEASES=${MATRIX_RELEASES:-$(releases TESTED_RELEASES)}
WITHOUT_ENGINES=$(releases TESTED_WITHOUT_ENGINES)
TESTS=${MATRIX_TESTS:-$(grep -v "^#" scripts/matrix-tests.txt | tr "\n" " ")}
out=matrix
mkdir -p "$out"
status=0
for release in $RELEASES; do
  if [[ "$release" == "0.32.0" ]]; then
    bash scripts/install.sh --test >/dev/null || { echo "install failed for $release" >&2; status=1; continue; }
    py=.venv/bin/python
  else
    bash scripts/matrix-env.sh "$release" || { echo "install failed for $release" >&2; status=1; continue; }
    py=.venvs/vllm-$release/bin/python
  fi
  printf '\n==> vLLM %s: %s\n' "$release" "$TESTS" >&2
  # shellcheck disable=SC2086
  junit="$out/junit-$release${MATRIX_RERUN:+.$MATRIX_RERUN}.xml"  # a rerun adds, not replaces
  device=()
  # The registry serves these only as vLLM's CUDA build: they run on the CPU platform, without
  # engines (tests/conftest.py skips those, with the reason, for such a build). From 0.34 the
  # CPU platform asks for Triton's CPU backend when it builds a config; with no GPU visible
  # (CUDA_VISIBLE_DEVICES empty) vLLM keeps the Triton it has, and no kernel ever runs.
  [[ " $WITHOUT_ENGINES " == *" $release "* ]] && device=(env VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES=)
  "${device[@]}" "$py" -m pytest -q -p no:cacheprovider --junitxml="$junit" $TESTS || status=1
done
"${PYTHON:-python3}" scripts/matrix_report.py "$out" docs/versions.md
exit $status
