test:
	bash scripts/test.sh

test-matrix:
	bash scripts/test-matrix.sh

.PHONY: test test-matrix
