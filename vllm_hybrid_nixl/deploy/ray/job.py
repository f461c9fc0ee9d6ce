"""Entry point for ``ray job submit``: serve a P/D deployment on the cluster the job runs in.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m vllm_hybrid_nixl.deploy.ray.job --config configs/ray/1p1d.yaml
"""

from __future__ import annotations

import argparse
import sys

from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config
from vllm_hybrid_nixl.deploy.ray.run import serve_until_signalled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="P/D YAML config (configs/ray/*.yaml)")
    parser.add_argument(
        "--address", default="auto", help="Ray cluster to join (default: the one running this job)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, address=args.address)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_until_signalled(config)


if __name__ == "__main__":
    sys.exit(main())
