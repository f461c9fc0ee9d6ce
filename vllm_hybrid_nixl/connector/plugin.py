"""The ``vllm.general_plugins`` entry point: registers our connectors by name.

vLLM calls every general plugin in every process it starts (API server, engine
core, workers, Ray actors), so :func:`register` must be cheap and idempotent.  The
connector module is imported lazily, when vLLM first builds a connector. It also asks
Linux for AMX tile permission (:mod:`.cpu_amx`): vLLM's CPU attention kernel needs it in a
decode engine whose first step decodes received KV.
"""

from __future__ import annotations

import logging

from vllm_hybrid_nixl import CONNECTOR_NAME, PUSH_CONNECTOR_NAME

logger = logging.getLogger("vllm.hybrid_nixl.plugin")

CONNECTOR_MODULE = "vllm_hybrid_nixl.connector.connectors"
CONNECTORS = {CONNECTOR_NAME: "HybridNixlConnector", PUSH_CONNECTOR_NAME: "HybridNixlPushConnector"}


def register() -> None:
    """Register ``HybridNixlConnector`` and ``HybridNixlPushConnector`` with vLLM (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_hybrid_nixl.connector.cpu_amx import ask_for_amx_tiles

    ask_for_amx_tiles(logger)

    for name, class_name in CONNECTORS.items():
        if name in KVConnectorFactory._registry:
            continue
        KVConnectorFactory.register_connector(name, CONNECTOR_MODULE, class_name)
        logger.debug("vllm-hybrid-nixl registered KV connector %s", name)
    from vllm_hybrid_nixl.connector.ray_serve import register_if_in_ray_serve

    register_if_in_ray_serve()  # Ray Serve LLM's backend registry, inside Serve replicas
