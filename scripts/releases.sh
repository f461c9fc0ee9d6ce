# Sourced by the matrix scripts: `releases NAME` prints a tuple of
# vllm_hybrid_nixl/common/releases.py (TESTED_RELEASES, TESTED_WITHOUT_ENGINES) space-separated.
releases() {
  "${PYTHON:-python3}" -c "import runpy, sys
print(' '.join(runpy.run_path('vllm_hybrid_nixl/common/releases.py')[sys.argv[1]]))" "$1"
}
