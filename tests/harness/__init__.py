"""Test harness: vLLM worker set-up for registration tests and release facts."""
