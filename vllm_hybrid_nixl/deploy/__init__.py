"""Processes: ``vllm serve`` engines as children or Ray actors, the container entry point,
CPU placement, the demo and a P/D client. The top layer below the CLI: may import every
other sub-package."""
