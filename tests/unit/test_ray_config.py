"""Deployment configuration: validation messages and what reaches `vllm serve`."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid_nixl.deploy.ray.config import ConfigError, load_config, make_config

pytestmark = pytest.mark.unit

CONFIG_DIR = Path(__file__).parents[2] / "configs" / "ray"
# configs/ray also holds Ray's own files (autoscaler, Serve), tested in test_deploy_configs.
NOT_OURS = {"cluster.yaml", "serve_pd.yaml"}
PD_CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p.name not in NOT_OURS)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_flags_become_vllm_serve_arguments(model_dir: Path) -> None:
    config = make_config(
        model=str(model_dir),
        block_size=64,
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        engine_args=["--seed", "3"],
    )
    assert config.serve_args() == [
        "--block-size",
        "64",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--seed",
        "3",
    ]


def test_hub_ids_are_not_checked_on_disk() -> None:
    assert make_config(model="org/some-model").model == "org/some-model"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": "/nope/missing"}, "model: model directory '/nope/missing' does not exist"),
        ({"connector": "Foo"}, "connector: unknown connector 'Foo'; use one of"),
        ({"connector": "HybridNixlPushConnector"}, "not supported by the router yet"),
        ({"num_prefill": 0}, "num_prefill: Input should be greater than or equal to 1"),
        ({"router_port": 70000}, "router_port: Input should be less than or equal to 65535"),
        ({"colour": "red"}, "colour: Extra inputs are not permitted"),
    ],
)
def test_invalid_settings_are_named(model_dir: Path, values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(**{"model": str(model_dir), **values})
    assert str(info.value).startswith("invalid P/D configuration: ")
    assert message in str(info.value)


@pytest.mark.parametrize("path", PD_CONFIGS, ids=lambda p: p.name)
def test_shipped_ray_configs_load(path: Path, model_dir: Path) -> None:
    config = load_config(path, model=str(model_dir))
    assert config.connector == "HybridNixlConnector"
    assert config.block_size == 64
    assert config.num_prefill >= 1 and config.num_decode >= 1


def test_two_by_two_config_places_roles_by_resource(model_dir: Path) -> None:
    config = load_config(CONFIG_DIR / "2p2d.yaml", model=str(model_dir))
    assert (config.num_prefill, config.num_decode) == (2, 2)
    assert config.prefill_resources == {"prefill_node": 1}
    assert config.decode_resources == {"decode_node": 1}


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_router_limits_come_from_the_config_and_typos_are_refused(model_dir: Path) -> None:
    config = make_config(model=str(model_dir), router={"max_n": 2, "body_timeout_s": 5})
    assert (config.router.max_n, config.router.body_timeout_s) == (2, 5.0)
    assert make_config(model=str(model_dir)).router.max_n == 16
    with pytest.raises(ConfigError, match="router.max_nn: Extra inputs are not permitted"):
        make_config(model=str(model_dir), router={"max_nn": 2})


@pytest.mark.parametrize(
    "name", ["VLLM_API_KEY", "VLLM_HYBRID_NIXL_API_KEY", "VLLM_HYBRID_NIXL_ENGINE_API_KEY"]
)
def test_keys_in_a_config_file_are_refused_with_where_they_belong(
    model_dir: Path, name: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_config(model=str(model_dir), env={name: "sk-123456"})
    message = str(caught.value)
    assert f"{name} does not belong in a config file" in message
    assert "export VLLM_HYBRID_NIXL_ENGINE_API_KEY" in message
    assert "sk-123456" not in message


def test_the_stock_connector_is_refused_before_anything_starts(tmp_path) -> None:
    """The launcher would refuse its pairs only after every engine had started."""
    from vllm_hybrid_nixl.deploy.ray.config import ConfigError, make_config

    with pytest.raises(ConfigError, match="NixlConnector .vLLM's stock connector. cannot"):
        make_config(model=str(tmp_path), connector="NixlConnector")
