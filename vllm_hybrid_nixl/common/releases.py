"""The vLLM releases this package is tested on: the one list everything else is checked against.

Plain constants and no imports, so ``setup.py`` (the ``cuda`` extra), ``scripts/test-matrix.sh``
(the matrix), the GPU ``Dockerfile`` (its base image default, held equal by a test), the
README's matrix table and ``connector.compat`` all read it.
"""

#: The first vLLM with ``nixl/base_worker.py``; older releases are refused.
MIN_SUPPORTED = "0.24.0"
#: The version matrix, oldest first; the last one is the newest tested release.
TESTED_RELEASES = ("0.25.1", "0.27.1", "0.32.0", "0.33.0", "0.34.0")
#: Served on the registry only as vLLM's CUDA build: tested on vLLM's CPU platform without
#: engines (classes, NIXL registration, the audit and transfers, KV-cache planning, ``check``).
TESTED_WITHOUT_ENGINES = ("0.33.0", "0.34.0")
NEWEST_TESTED = TESTED_RELEASES[-1]
