# A Python 3.11 base for Dockerfile.cpu made from Debian's packages, for machines that reach
# no image registry: FROM a local Debian image (scripts/container/local-base.sh imports one
# made with debootstrap). The CA bundle of a TLS-inspecting proxy comes in as the build
# secret ca_bundle (optional).
ARG DEBIAN_IMAGE=localhost/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN --mount=type=secret,id=ca_bundle,target=/run/secrets/ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then \
        cp /run/secrets/ca_bundle /usr/local/share/ca-certificates/build-ca.crt; fi \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-pip python3-venv python-is-python3 ca-certificates passwd \
    && update-ca-certificates \
    && rm -rf /var/lib/apt/lists/*
