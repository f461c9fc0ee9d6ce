"""What two engines and the router must agree on, as plain data: the HMA-aware layout
check, the layout fingerprint and its wire form, the NIXL side-channel probe, the KV lease
table and its wire protocol, and what a model's config says about its state. Imports no vLLM
and nothing else of this package except ``common``."""
