"""What vLLM loads into its processes: the plugin entry point, the connector and worker
subclasses, the lease guard's connector side, the compat module (every vLLM version branch),
NIXL progress-thread care, the Mamba start-up guard and the engine launcher. Imports
``protocol`` and ``common`` only."""

from typing import Any

_CLASSES = ("HybridNixlConnector", "HybridNixlPushConnector")


def __getattr__(name: str) -> Any:
    """``kv_connector_module_path: vllm_hybrid_nixl.connector`` finds the classes here;
    vLLM is imported only when one is asked for."""
    if name in _CLASSES:
        from vllm_hybrid_nixl.connector import connectors

        return getattr(connectors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
