"""Helpers shared by the tests and the benchmarks (they import vLLM; not for serving)."""
