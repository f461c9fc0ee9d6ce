# A Python 3.11 base for Dockerfile.cpu made from Debian's packages, for machines that reach
# no image registry: FROM a local Debian image (scripts/container/local-base.sh imports one
# made with debootstrap). The CA bundle of a TLS-inspecting proxy comes in as the build
# secret ca_bundle (optional).
ARG DEBIAN_IMAGE=localhost/debian:bookworm
FROM ${DEBIAN_IMAGE}
# Debian stable's own Python: versions follow the release, not pins (hence DL3008).
# hadolint ignore=DL3008
RUN --mount=type=secret,id=ca_bundle,target=/run/secrets/ca_bundle \
    apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-pip python3-venv python-is-python3 ca-certificates passwd \
    && rm -rf /var/lib/apt/lists/* \
    && if [ -s /run/secrets/ca_bundle ]; then \
        cp /run/secrets/ca_bundle /usr/local/share/ca-certificates/build-ca.crt; fi \
    && update-ca-certificates
