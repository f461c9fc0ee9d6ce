"""``vllm-hybrid-nixl check``: builds both sides' KV-cache configuration with vLLM (no engine)
and compares their layout fingerprints. Imports ``connector``, ``protocol`` and ``common``."""
