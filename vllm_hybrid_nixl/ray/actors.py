"""A Ray actor that starts, watches and stops one ``vllm serve`` on its node."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import ray

from vllm_hybrid_nixl.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.netutil import free_port


def node_ip_of_this_actor() -> str:
    """The IP this node registered with Ray (``--node-ip-address``), which peers use.

    ``ray.util.get_node_ip_address()`` guesses from the routing table instead, and would
    advertise the machine's outward address on a cluster bound to 127.0.0.1.
    """
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


@ray.remote
class EngineActor:
    """One engine: its HTTP and NIXL side-channel ports are picked on the actor's node and
    the side channel is advertised on the node's IP, so peers on other nodes reach it."""

    def __init__(
        self,
        name: str,
        role: str,
        model: str,
        connector: str,
        kv_buffer_device: str,
        serve_args: list[str],
        env: dict[str, str],
        log_dir: str,
        cpu_core: int | None,
    ) -> None:
        node_ip = node_ip_of_this_actor()
        engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        spec = EngineSpec(
            model=model,
            port=free_port(node_ip),
            role=role,
            connector=connector,
            side_channel_port=free_port(node_ip),
            host=node_ip,
            cpu_core=cpu_core if kv_buffer_device == "cpu" else None,
            kv_buffer_device=kv_buffer_device,
            extra_args=list(serve_args),
            env=dict(env),
            engine_id=engine_id if role != "none" else None,
        )
        self.name = name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.engine = EngineProcess(spec, Path(log_dir) / f"{name}.log")

    def start(self) -> dict[str, Any]:
        self.engine.start()
        return self.info()

    def info(self) -> dict[str, Any]:
        spec = self.engine.spec
        return {
            "name": self.name,
            "role": spec.role,
            "url": spec.url,
            "node_ip": spec.host,
            "node_id": self.node_id,
            "side_channel": f"{spec.host}:{spec.side_channel_port}",
            "engine_id": spec.engine_id,
            "pid": self.engine.pid,
            "log": str(self.engine.log_path),
        }

    def status(self) -> dict[str, Any]:
        """alive: the process runs; healthy: its /health answered 200."""
        alive = self.engine.alive()
        healthy = False
        if alive:
            try:
                healthy = (
                    httpx.get(f"{self.engine.spec.url}/health", timeout=2.0).status_code == 200
                )
            except httpx.HTTPError:
                healthy = False
        code = None if alive or self.engine.process is None else self.engine.process.returncode
        return {"alive": alive, "healthy": healthy, "returncode": code}

    def log_tail(self, lines: int = 25) -> str:
        return self.engine.log_tail(lines)

    def stop(self) -> None:
        self.engine.stop()
