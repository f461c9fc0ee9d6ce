"""A Ray actor that starts, supervises and stops one ``vllm serve`` on its node.

Supervision: when the engine's process exits on its own, the actor starts it again on the
same ports (bounded restarts, exponential backoff), under a new NIXL ``engine_id`` so that
peers holding the dead engine's NIXL metadata handshake afresh. The router takes it back
once its ``/health`` answers.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec, answers_health
from vllm_hybrid_nixl.deploy.placement import machine_id


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
        max_restarts: int = 3,
        restart_backoff_s: float = 2.0,
    ) -> None:
        node_ip = node_ip_of_this_actor()
        engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        spec = EngineSpec(
            model=model,
            port=free_port(node_ip),
            role=role,
            connector=connector,
            side_channel_port=free_side_channel_port(node_ip),
            host=node_ip,
            cpu_core=cpu_core if kv_buffer_device == "cpu" else None,
            kv_buffer_device=kv_buffer_device,
            extra_args=list(serve_args),
            env=dict(env),
            engine_id=engine_id if role != "none" else None,
        )
        self.name = name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.log_dir = Path(log_dir)
        self.engine = EngineProcess(spec, self.log_dir / f"{name}.log")
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        self.restarts = 0
        self.planned_restarts = 0
        self.restart_log: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def node_facts(self) -> tuple[list[int], str]:
        """(The cores this node may run on, its machine): the deployment shares
        the cores among the engines placed on the machine with them. The cores are the
        raylet's CPU affinity (a container's cpuset, ``taskset``), not every core of the
        machine, so raylets given disjoint cores on one machine never put two engines on
        one core; the machine (``placement.machine_id``) groups raylets that share cores."""
        return sorted(os.sched_getaffinity(0)) or [0], machine_id()

    def start(self, cpu_cores: list[int] | None = None) -> dict[str, Any]:
        """Start the engine; ``cpu_cores``: its share of this node's cores (CPU engines)."""
        if cpu_cores is not None and self.engine.spec.kv_buffer_device == "cpu":
            self.engine.spec = dataclasses.replace(self.engine.spec, cpu_core=list(cpu_cores))
        self.engine.start()
        return self.info()

    def supervise(self) -> None:
        """From now on, restart the engine when its process exits (called once it served:
        an engine that cannot start is reported, not restarted)."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._supervise, name="supervise", daemon=True)
            self._watcher.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(1.0):
            with self._lock:
                if self.engine.alive() or self._stopping.is_set():
                    continue
                code = self.engine.process.returncode if self.engine.process else None
                if self.restarts >= self.max_restarts:
                    print(
                        f"{self.name}: engine exited with code {code}; restart limit "
                        f"({self.max_restarts}) reached, not restarting",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                delay = self.restart_backoff_s * 2**self.restarts
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self.engine.stop()  # what outlived the API server holds its ports
                old = self.engine.spec
                spec = dataclasses.replace(
                    old,
                    engine_id=f"{self.name}-{uuid.uuid4().hex[:8]}" if old.engine_id else None,
                )
                log = self.log_dir / f"{self.name}.restart-{self.restarts}.log"
                self.engine = EngineProcess(spec, log).start()
                self.restart_log.append(
                    {"at": time.time(), "exit_code": code, "pid": self.engine.pid, "log": str(log)}
                )
                print(
                    f"{self.name}: engine exited with code {code}; restarted "
                    f"({self.restarts}/{self.max_restarts}) as pid {self.engine.pid}",
                    file=sys.stderr,
                    flush=True,
                )

    def restart(self, drain_timeout_s: float = 120.0) -> dict[str, Any]:
        """Stop the engine (SIGTERM: it drains, then exits) and start it again on the same
        ports under a new NIXL engine id; asked for (a rolling restart), so it does not count
        towards ``max_restarts``. The stop's seconds and exit code are in the answer."""
        with self._lock:
            started = time.monotonic()
            self.engine.stop(timeout_s=drain_timeout_s)
            stopped_s = time.monotonic() - started
            code = self.engine.process.returncode if self.engine.process else None
            old = self.engine.spec
            spec = dataclasses.replace(
                old, engine_id=f"{self.name}-{uuid.uuid4().hex[:8]}" if old.engine_id else None
            )
            self.planned_restarts += 1
            log = self.log_dir / f"{self.name}.rolling-{self.planned_restarts}.log"
            self.engine = EngineProcess(spec, log).start()
        return {**self.info(), "stopped_s": round(stopped_s, 1), "exit_code": code}

    def info(self) -> dict[str, Any]:
        spec = self.engine.spec
        return {
            "name": self.name,
            "role": spec.role,
            "url": spec.url,
            "node_ip": spec.host,
            "node_id": self.node_id,
            "side_channel": spec.side_channel,
            "engine_id": spec.engine_id,
            "pid": self.engine.pid,
            "log": str(self.engine.log_path),
            "restarts": self.restarts,
        }

    def status(self) -> dict[str, Any]:
        """alive: the process runs; healthy: its /health answered 200."""
        alive = self.engine.alive()
        healthy = alive and answers_health(self.engine.spec.url)
        code = None if alive or self.engine.process is None else self.engine.process.returncode
        return {
            "alive": alive,
            "healthy": healthy,
            "returncode": code,
            "restarts": self.restarts,
            "pid": self.engine.pid,
        }

    def log_tail(self, lines: int = 25) -> str:
        return self.engine.log_tail(lines)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self.engine.stop()
