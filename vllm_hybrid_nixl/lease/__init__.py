"""The KV lease guard: a decode engine never samples from prefill blocks that were released.

``table`` is the prefill engine's record of which requests' blocks it still holds (plain
data, no vLLM), ``wire`` the small request/reply protocol a decode engine (and the router)
uses to pin and query those leases, ``connector_side`` what our connector adds to vLLM's
scheduler and worker to use them.
"""
