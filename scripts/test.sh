#!/usr/bin/env bash
# The test command: set up .venv from scratch (scripts/install.sh --test), then run the suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export HF_HUB_OFFLINE=1
.venv/bin/ruff check vllm_hybrid_nixl tests bench scripts
.venv/bin/hadolint Dockerfile Dockerfile.cpu
# The docs site: broken links, missing pages and pages outside the nav fail.
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
.venv/bin/python -m pytest "$@"
