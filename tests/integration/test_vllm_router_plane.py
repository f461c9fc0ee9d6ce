"""Choosing vllm-router as the data plane: the config and flags that name it, how our settings
become its flags, and what is refused before any engine starts. The real vllm-router binary
is started here over engines that cannot be reached, and refused by our pairing check; it
serves real engines in ``tests/e2e/test_serve_mamba.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_hybrid_nixl.cli import build_parser
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config, make_config
from vllm_hybrid_nixl.deploy.ray.deployment import PDDeployment
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterProcess
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings
from vllm_hybrid_nixl.router.vllm_router import (
    INSTALL_HINT,
    VllmRouterError,
    VllmRouterProcess,
    vllm_router_args,
    vllm_router_binary,
)

pytestmark = pytest.mark.integration


def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_the_ray_config_names_the_data_plane(model_dir: Path, tmp_path: Path) -> None:
    config_file = tmp_path / "pd.yaml"
    config_file.write_text(f"model: {model_dir}\nrouter:\n  kind: vllm-router\n")
    config = load_config(config_file)
    assert config.router.kind == "vllm-router"
    assert make_config(model=str(model_dir)).router.kind == "vllm-hybrid-nixl"
    with pytest.raises(ConfigError, match="router.kind") as caught:
        make_config(model=str(model_dir), router={"kind": "nginx"})
    assert "vllm-router" in str(caught.value) and "vllm-hybrid-nixl" in str(caught.value)


def test_the_deployment_starts_the_named_data_plane(model_dir: Path) -> None:
    pool = BackendPool.from_urls([nowhere()], [nowhere()])
    ours = PDDeployment(make_config(model=str(model_dir)), keys=RouterKeys())
    assert isinstance(ours._data_plane(pool), RouterProcess)
    peer = PDDeployment(
        make_config(model=str(model_dir), router={"kind": "vllm-router"}), keys=RouterKeys()
    )
    assert isinstance(peer._data_plane(pool), VllmRouterProcess)


def test_flags_name_the_data_plane() -> None:
    parser = build_parser()
    router = parser.parse_args(
        ["router", "--prefill", "http://a", "--decode", "http://b", "--router-kind", "vllm-router"]
    )
    assert router.kind == "vllm-router"
    serve = parser.parse_args(["serve", "--model", "m", "--router-kind", "vllm-router"])
    assert serve.router_kind == "vllm-router"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--router-kind", "nginx"])


def test_our_settings_become_vllm_routers_flags() -> None:
    pool = BackendPool.from_urls(["http://p0", "http://p1"], ["http://d0"])
    settings = RouterSettings(
        prefill_policy="prefix_affinity",
        decode_policy="round_robin",
        prefill_timeout_s=20,
        decode_read_timeout_s=45,
        max_body_bytes=1000,
    )
    args = vllm_router_args(pool, "127.0.0.1", 9000, 9001, settings)
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "--vllm-pd-disaggregation"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--prefill"] == [
        "http://p0",
        "http://p1",
    ]
    assert pairs["--prefill-policy"] == "cache_aware" and pairs["--decode-policy"] == "round_robin"
    assert pairs["--request-timeout-secs"] == "45" and pairs["--max-payload-size"] == "1000"
    defaults = vllm_router_args(pool, "127.0.0.1", 9000, 9001, RouterSettings())
    pairs = dict(zip(defaults[1::2], defaults[2::2], strict=False))
    assert pairs["--prefill-policy"] == "power_of_two"  # least_in_flight's nearest policy
    assert pairs["--decode-policy"] == "round_robin"  # vllm-router refuses it over one engine


def test_keys_are_refused_before_any_engine_starts(model_dir: Path) -> None:
    """The launcher does not hand keys to vllm-router: a deployment asking for them fails
    at once, naming the variables and the default router, before Ray or an engine starts."""
    config = make_config(model=str(model_dir), router={"kind": "vllm-router"})
    deployment = PDDeployment(config, keys=RouterKeys(api_key="sk-a-client-key"))
    with pytest.raises(VllmRouterError, match="VLLM_HYBRID_NIXL_API_KEY") as caught:
        deployment.start()
    assert "kind: vllm-hybrid-nixl" in str(caught.value)
    assert deployment.engines == []
    assert "sk-a-client-key" not in str(caught.value)


def test_a_pool_whose_layouts_cannot_be_read_is_refused(tmp_path: Path) -> None:
    """vllm-router pairs every prefill with every decode engine, so one unread layout
    refuses the whole pool: the real binary is never started."""
    pool = BackendPool.from_urls([nowhere()], [nowhere()])
    router = VllmRouterProcess(pool, log_path=tmp_path / "vr.log")
    with pytest.raises(VllmRouterError, match="could not be read"):
        router.start()
    assert router.pid is None


def test_a_missing_vllm_router_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Path(vllm_router_binary()).is_file()  # installed with the test extras
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(VllmRouterError, match="vllm-router") as caught:
        vllm_router_binary()
    assert INSTALL_HINT in str(caught.value)
