"""P/D on a Ray cluster: engines as Ray actors that supervise ``vllm serve``, a router in
front. vLLM is only imported inside the engine processes."""
