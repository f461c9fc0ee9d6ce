"""The router in front of engines our launchers start keeps idle connections for a share of
the engines' own keep-alive (so a burst after a quiet spell finds them open), never longer,
and never overrides what the operator set."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid_nixl.deploy.keepalive import ENGINE_KEEP_ALIVE_S, KEEP_ALIVE_VAR, ROUTER_SHARE
from vllm_hybrid_nixl.deploy.ray.config import make_config
from vllm_hybrid_nixl.deploy.ray.deployment import PDDeployment
from vllm_hybrid_nixl.router.settings import RouterKeys, RouterSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def router_keep_alive(model_dir: str, **config: object) -> float:
    deployment = PDDeployment(make_config(model=model_dir, **config), keys=RouterKeys())
    return deployment.router_settings.keepalive_expiry_s


def test_the_router_keeps_connections_for_a_share_of_the_engines_keep_alive(
    model_dir: str,
) -> None:
    default = router_keep_alive(model_dir)
    assert default == ENGINE_KEEP_ALIVE_S * ROUTER_SHARE
    assert RouterSettings().keepalive_expiry_s < default  # engines it did not start: 1 s
    assert router_keep_alive(model_dir, env={KEEP_ALIVE_VAR: "10"}) == 10 * ROUTER_SHARE


def test_what_the_operator_set_wins(model_dir: str) -> None:
    assert router_keep_alive(model_dir, router={"keepalive_expiry_s": 2.5}) == 2.5
    unreadable = router_keep_alive(model_dir, env={KEEP_ALIVE_VAR: "forever"})
    assert unreadable == RouterSettings().keepalive_expiry_s
