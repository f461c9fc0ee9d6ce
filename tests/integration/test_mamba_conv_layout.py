"""A Mamba engine without the DS conv-state layout is refused when its connector starts,
with the variable named (vLLM's NIXL worker, under our worker subclass, on the real config
of the tiny NemotronH). Our launchers set DS (``test_pd_mamba``, ``test_serve_mamba``).
Each case runs in a fresh interpreter: vLLM reads the variable once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
    import sys, uuid
    from vllm.config import set_current_vllm_config
    from tests.harness import worker_harness as harness
    from vllm_hybrid_nixl.connector.worker import HybridNixlPullWorker

    with harness.model_setup(sys.argv[1]) as setup, set_current_vllm_config(setup.vllm_config):
        worker = HybridNixlPullWorker(setup.vllm_config, str(uuid.uuid4()), setup.kv_cache_config)
        worker.shutdown()
    print("WORKER STARTED")
    """
)


@pytest.fixture(scope="module")
def mamba_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("nemotron-h"), TinyModelSpec("nemotron-h"))


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_conv_state_layout_other_than_ds_is_refused_by_name(mamba_model: Path, layout: str) -> None:
    env = {**os.environ, "VLLM_SSM_CONV_STATE_LAYOUT": layout}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(mamba_model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if layout == "DS":
        assert done.returncode == 0 and "WORKER STARTED" in done.stdout, done.stderr[-3000:]
    else:
        assert done.returncode != 0 and "WORKER STARTED" not in done.stdout
        assert "Set VLLM_SSM_CONV_STATE_LAYOUT=DS" in done.stderr, done.stderr[-3000:]
