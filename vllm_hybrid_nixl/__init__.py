"""vllm-hybrid-nixl: NIXL prefill/decode disaggregation for hybrid (HMA) models in vLLM.

Importing this package does not import vLLM; the connector classes live in
``vllm_hybrid_nixl.connector`` and are registered by ``vllm_hybrid_nixl.plugin``.
"""

__version__ = "0.1.0"

CONNECTOR_NAME = "HybridNixlConnector"
PUSH_CONNECTOR_NAME = "HybridNixlPushConnector"
