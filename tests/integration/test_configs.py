"""The shipped ``configs/*.yaml`` parse with vLLM's own ``vllm serve`` argument parser and
name our connector with the right role."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@pytest.fixture(scope="module")
def serve_parser():
    from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

    install_cpu_version_alias()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def test_there_are_configs_for_both_roles_on_both_platforms() -> None:
    assert {path.name for path in CONFIGS} >= {
        "prefill-cpu.yaml",
        "decode-cpu.yaml",
        "prefill-gpu.yaml",
        "decode-gpu.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_with_vllm_serve(serve_parser, path: Path) -> None:
    args = serve_parser.parse_args(["serve", "/models/some-model", "--config", str(path)])
    kv = args.kv_transfer_config
    assert kv.kv_connector == "HybridNixlConnector"
    assert kv.kv_role == ROLES[path.name.split("-")[0]]
    assert kv.kv_buffer_device == path.stem.split("-")[1].replace("gpu", "cuda")
    assert args.block_size == 64  # P and D must agree; both ship the same value
