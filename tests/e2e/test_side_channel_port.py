"""An engine whose NIXL side-channel port is taken stops at start-up with an error naming the
port and the fix. vLLM alone waits forever for its handshake listener there (the listener
thread dies on "Address already in use"; ``/health`` never answers)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector.side_channel import SideChannelPortInUse, refuse_busy_side_channel
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec

MESSAGE = "side-channel port 127.0.0.1:{port} is already in use"


class _Scheduler:
    """Only the two attributes of vLLM's NIXL scheduler that the check reads."""

    side_channel_host = "127.0.0.1"

    def __init__(self, port: int) -> None:
        self.side_channel_port = port


def test_the_check_refuses_a_listening_port_and_passes_a_free_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        with pytest.raises(SideChannelPortInUse, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
            refuse_busy_side_channel(_Scheduler(port))
    refuse_busy_side_channel(_Scheduler(port))  # released: passes


@pytest.mark.e2e
def test_engine_with_a_taken_side_channel_port_exits_with_the_reason(
    tiny_hybrid_model: Path, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        spec = EngineSpec(
            model=str(tiny_hybrid_model),
            port=free_port(),
            role="prefill",
            side_channel_port=port,
            extra_args=["--enforce-eager", "--max-model-len", "512", "--block-size", "64"],
        )
        engine = EngineProcess(spec, tmp_path / "engine.log").start()
        try:
            deadline = time.monotonic() + 420
            while engine.alive() and time.monotonic() < deadline:
                if MESSAGE.format(port=port) in engine.log_text():
                    break
                time.sleep(1)
            assert MESSAGE.format(port=port) in engine.log_text(), engine.log_tail(40)
            assert "What to change" in engine.log_text()
        finally:
            engine.stop()


@pytest.mark.e2e
def test_engine_with_a_taken_lease_port_exits_with_the_reason(
    tiny_hybrid_model: Path, tmp_path: Path
) -> None:
    """A configured ``lease_port`` that is taken stops the prefill engine by name (a derived
    default that is taken falls back to a free port with a warning instead)."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        spec = EngineSpec(
            model=str(tiny_hybrid_model),
            port=free_port(),
            role="prefill",
            side_channel_port=free_side_channel_port(),
            kv_extra_config={"lease_port": port},
            extra_args=["--enforce-eager", "--max-model-len", "512", "--block-size", "64"],
        )
        engine = EngineProcess(spec, tmp_path / "engine.log").start()
        wanted = f"KV lease service could not listen on 127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 420
            while engine.alive() and time.monotonic() < deadline:
                if wanted in engine.log_text():
                    break
                time.sleep(1)
            assert wanted in engine.log_text(), engine.log_tail(40)
            assert "give each engine on this host its own lease_port" in engine.log_text()
        finally:
            engine.stop()
