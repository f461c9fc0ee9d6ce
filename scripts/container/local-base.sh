#!/usr/bin/env bash
# Make the base images Dockerfile.cpu can start FROM where no image registry is reachable:
# a minimal Debian (debootstrap) imported as localhost/debian:bookworm, then a Python 3.11
# image on it, localhost/vllm-hybrid-nixl-base:py3.11. Each is skipped when it exists.
#
#   ENGINE     the container CLI (default: podman, else docker)
#   CA_BUNDLE  a CA bundle the build needs to reach Debian's archive through a TLS-inspecting
#              proxy (default: /etc/ssl/certs/ca-certificates.crt when it exists)
#   MIRROR     Debian mirror (default: http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/../.."
ENGINE=${ENGINE:-$(command -v podman || command -v docker)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
DEBIAN_IMAGE=localhost/debian:bookworm
BASE_IMAGE=localhost/vllm-hybrid-nixl-base:py3.11

has_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

if ! has_image "$DEBIAN_IMAGE"; then
    command -v debootstrap >/dev/null || { echo "debootstrap is not installed" >&2; exit 1; }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "==> debootstrap --variant=minbase bookworm ($MIRROR)" >&2
    started=$SECONDS
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; exit 1; }
    tar -C "$root" -c . | "$ENGINE" import - "$DEBIAN_IMAGE" >/dev/null
    echo "    $DEBIAN_IMAGE in $((SECONDS - started)) s" >&2
fi
if ! has_image "$BASE_IMAGE"; then
    echo "==> $BASE_IMAGE (Debian's Python 3.11)" >&2
    started=$SECONDS
    secret=()
    [[ -s "$CA_BUNDLE" ]] && secret=(--secret "id=ca_bundle,src=$CA_BUNDLE")
    "$ENGINE" build --quiet "${secret[@]}" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
        -f scripts/container/python-base.Dockerfile -t "$BASE_IMAGE" scripts/container >/dev/null
    echo "    $BASE_IMAGE in $((SECONDS - started)) s" >&2
fi
echo "$BASE_IMAGE"
