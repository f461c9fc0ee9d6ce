"""vllm-hybrid-nixl: NIXL prefill/decode disaggregation for hybrid (HMA) models in vLLM.

Importing this package does not import vLLM. Sub-packages, lowest first (each imports only
those before it): ``common`` and ``protocol`` (plain data), ``connector`` (what vLLM loads; the
classes live in ``connector.connectors`` and ``connector.plugin`` registers them), ``tools``,
``preflight`` and ``router``, ``deploy``; ``cli`` on top.
"""

__version__ = "0.1.0"

CONNECTOR_NAME = "HybridNixlConnector"
PUSH_CONNECTOR_NAME = "HybridNixlPushConnector"
