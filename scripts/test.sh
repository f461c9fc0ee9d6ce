#!/usr/bin/env bash
# The test command: set up .venv from scratch (scripts/install.sh --test), then run the suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export HF_HUB_OFFLINE=1
.venv/bin/ruff check vllm_hybrid_nixl tests bench scripts
.venv/bin/hadolint Dockerfile Dockerfile.cpu scripts/container/python-base.Dockerfile
# The docs site: broken links, missing pages and pages outside the nav fail.
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
# What the machine is: a CI failure that does not happen elsewhere starts from these facts.
echo "==> machine: $(nproc) cores (affinity $(awk '/Cpus_allowed_list/{print $2}' /proc/self/status)), \
$(awk '/MemTotal/{t=$2} /MemAvailable/{a=$2} END{printf "%.0f GiB, %.0f available", t/2^20, a/2^20}' /proc/meminfo), \
/tmp free $(df -h /tmp | awk 'NR==2{print $4}'), uid $(id -u), \
ephemeral ports $(tr '\t' '-' < /proc/sys/net/ipv4/ip_local_port_range), cwd $PWD"
echo "    cpu: $(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo), \
$(grep -c ^processor /proc/cpuinfo) online, cgroup cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo -), \
amx: $(grep -qw amx_tile /proc/cpuinfo && echo yes || echo no), \
Ray counts $(.venv/bin/python -c 'import ray._private.utils as u; print(u.get_num_cpus())' 2>/dev/null || echo '?')"
env | grep -E '^(RAY|VLLM|PYTEST|UCX|NIXL|OMP|CUDA|HF|TMPDIR|XDG)[A-Z_]*=' | grep -vE '^[A-Z_]*(TOKEN|KEY|SECRET|PASS)[A-Z_]*=' | sed 's/^/    env: /' || true
.venv/bin/python -m pytest "$@"
