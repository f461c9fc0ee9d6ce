"""Ray Serve LLM support: our connector names in Ray's KV-connector backend registry.

Ray Serve LLM looks up a "backend" per ``kv_connector`` name to prepare each replica (NIXL
side-channel host and port, a unique ``engine_id``) and to shape P/D requests; an unknown
name silently gets a backend that does nothing, so two replicas on one node would fight
over the default side-channel port. ``HybridNixlConnector`` speaks NIXL's pull protocol
exactly as ``NixlConnector`` does, so it gets Ray's own NIXL backend.

Ray's registry lives in Ray's internal key-value store: registering once in the process
that builds the application (:func:`build_pd_openai_app`, the ``import_path`` of
``configs/ray/serve_pd.yaml``) makes the name resolve in every replica of the cluster.
"""

from __future__ import annotations

import logging
import sys

from vllm_hybrid_nixl import CONNECTOR_NAME

logger = logging.getLogger("vllm.hybrid_nixl.ray_serve")

RAY_NIXL_BACKEND = "ray.llm._internal.serve.engines.vllm.kv_transfer.nixl:NixlConnectorBackend"
# Pull mode only: Ray's P/D orchestrator runs the decode leg after the prefill leg, which
# is what a push request cannot do (see the README's known limitations).
RAY_BACKENDS = {CONNECTOR_NAME: RAY_NIXL_BACKEND}


def register_ray_serve_backends() -> bool:
    """Register our connector names with Ray Serve LLM (idempotent); False when Ray Serve
    LLM is not importable here."""
    try:
        from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
            KVConnectorBackendFactory,
        )
    except ImportError as exc:
        logger.debug("Ray Serve LLM not importable (%s); nothing registered", exc)
        return False
    for name, backend in RAY_BACKENDS.items():
        if not KVConnectorBackendFactory.is_registered(name):
            KVConnectorBackendFactory.register_backend(name, backend)
            logger.debug("registered %s with Ray Serve LLM as %s", name, backend)
    return True


def register_if_in_ray_serve() -> None:
    """From the vLLM plugin: register only where Ray Serve is already loaded (a Serve
    replica), so plain ``vllm serve`` processes never import it."""
    if "ray.serve" in sys.modules:
        register_ray_serve_backends()
