"""An engine whose NIXL side-channel port is taken stops at start-up with an error naming the
port and the fix. vLLM alone waits forever for its handshake listener there (the listener
thread dies on "Address already in use"; ``/health`` never answers)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector.side_channel import SideChannelPortInUse, refuse_busy_side_channel
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec, stop_engines

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


ARGS = ["--enforce-eager", "--max-model-len", "512", "--block-size", "64"]


@dataclass
class RefusedStart:
    """An engine started on a taken port, its log once it said ``wanted`` (or stopped)."""

    port: int
    wanted: str
    log: str = ""


@pytest.fixture(scope="module")
def refused_starts(
    tiny_hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RefusedStart]]:
    """Both engines at once (each refusal comes late in start-up; one after the other they
    took twice as long): one whose side-channel port is taken, one whose configured
    ``lease_port`` is taken; each runs until its log names the port, it stops, or 420 s."""
    logs = tmp_path_factory.mktemp("taken-ports")
    with (
        socket.create_server(("127.0.0.1", 0)) as side_holder,
        socket.create_server(("127.0.0.1", 0)) as lease_holder,
    ):
        side_port, lease_port = side_holder.getsockname()[1], lease_holder.getsockname()[1]
        starts = {
            "side_channel": RefusedStart(side_port, MESSAGE.format(port=side_port)),
            "lease": RefusedStart(
                lease_port, f"KV lease service could not listen on 127.0.0.1:{lease_port}"
            ),
        }
        specs = {
            "side_channel": EngineSpec(
                model=str(tiny_hybrid_model),
                port=free_port(),
                role="prefill",
                side_channel_port=side_port,
                extra_args=ARGS,
                cpu_core=0,
            ),
            "lease": EngineSpec(
                model=str(tiny_hybrid_model),
                port=free_port(),
                role="prefill",
                side_channel_port=free_side_channel_port(),
                kv_extra_config={"lease_port": lease_port},
                extra_args=ARGS,
                cpu_core=1,
            ),
        }
        engines = {k: EngineProcess(spec, logs / f"{k}.log").start() for k, spec in specs.items()}
        try:
            deadline = time.monotonic() + 420
            waiting = set(engines)
            while waiting and time.monotonic() < deadline:
                for key in list(waiting):
                    engine = engines[key]
                    if not engine.alive() or starts[key].wanted in engine.log_text():
                        waiting.discard(key)
                time.sleep(1)
            for key, engine in engines.items():
                starts[key].log = engine.log_text() or engine.log_tail(40)
        finally:
            stop_engines(engines.values())
        yield starts


@pytest.mark.e2e
def test_engine_with_a_taken_side_channel_port_exits_with_the_reason(
    refused_starts: dict[str, RefusedStart],
) -> None:
    start = refused_starts["side_channel"]
    assert start.wanted in start.log, start.log[-4000:]
    assert "What to change" in start.log


@pytest.mark.e2e
def test_engine_with_a_taken_lease_port_exits_with_the_reason(
    refused_starts: dict[str, RefusedStart],
) -> None:
    """A configured ``lease_port`` that is taken stops the prefill engine by name (a derived
    default that is taken falls back to a free port with a warning instead)."""
    start = refused_starts["lease"]
    assert start.wanted in start.log, start.log[-4000:]
    assert "give each engine on this host its own lease_port" in start.log
