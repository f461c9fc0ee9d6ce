"""The P/D router: an OpenAI-compatible front end that sends each request's prefill leg to a
prefill engine and its decode leg (with the prefill's ``kv_transfer_params``) to a decode
engine. No vLLM import."""

from vllm_hybrid_nixl.router.app import build_app
from vllm_hybrid_nixl.router.backends import Backend, BackendPool

__all__ = ["Backend", "BackendPool", "build_app"]
