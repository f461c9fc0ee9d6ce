"""Start and stop ``vllm serve`` engines as child processes (used by the demo and tests).

Each engine runs in its own process group and is stopped by that PID, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from vllm_hybrid_nixl.common.processes import die_with_parent, kill_leftover_group
from vllm_hybrid_nixl.deploy.keepalive import set_engine_keep_alive
from vllm_hybrid_nixl.deploy.mamba_defaults import mamba_engine_args, set_mamba_environment
from vllm_hybrid_nixl.deploy.placement import cpu_list

ROLE_TO_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def answers_health(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url``/health answers 200 now: the one synchronous health poll of engines
    (and of a container's server) that deployment code uses."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def start_engine_child(cores: list[int] | None) -> None:
    """In the engine's child before ``exec``: SIGTERM when we die, and confined to ``cores``
    when given — its engine-core and worker processes inherit that. Measured on two cores
    with only the compute threads bound: the engines' other processes (vLLM's engine core
    spins on its worker queue) drifted onto the other engine's core, and in some runs the
    prefill worker got a quarter of its core (TTFT p50 several times the pinned engines',
    output throughput under half)."""
    die_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)


class EngineStartError(RuntimeError):
    """A ``vllm serve`` process exited or did not become healthy in time."""


@dataclass
class EngineSpec:
    """How to start one engine on this machine."""

    model: str
    port: int
    role: str = "prefill"  # prefill | decode | both | none (no KV connector)
    connector: str = "HybridNixlConnector"
    side_channel_port: int = 5600
    host: str = "127.0.0.1"
    #: The core(s) the engine runs on: vLLM binds its compute threads to them, and every
    #: process of the engine (API server, engine core, workers) is confined to them.
    cpu_core: int | list[int] | None = None
    kv_buffer_device: str = "cpu"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kv_extra_config: dict[str, object] = field(default_factory=dict)
    connector_module_path: str | None = None  # load the connector by module, not by name
    engine_id: str | None = None  # vLLM makes one up when unset
    kv_load_failure_policy: str | None = None  # fail | recompute (vLLM 0.30+); None: vLLM's

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cores(self) -> list[int] | None:
        if self.cpu_core is None:
            return None
        return [self.cpu_core] if isinstance(self.cpu_core, int) else list(self.cpu_core)

    @property
    def side_channel(self) -> str:
        """``host:port`` of its NIXL side channel (what the router's layout check asks)."""
        return f"{self.host}:{self.side_channel_port}"

    def kv_transfer_config(self) -> dict[str, object] | None:
        if self.role == "none":
            return None
        config: dict[str, object] = {
            "kv_connector": self.connector,
            "kv_role": ROLE_TO_KV_ROLE[self.role],
            "kv_buffer_device": self.kv_buffer_device,
        }
        if self.kv_extra_config:
            config["kv_connector_extra_config"] = self.kv_extra_config
        if self.connector_module_path:
            config["kv_connector_module_path"] = self.connector_module_path
        if self.engine_id:
            config["engine_id"] = self.engine_id
        if self.kv_load_failure_policy:
            config["kv_load_failure_policy"] = self.kv_load_failure_policy
        return config

    def command(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "vllm_hybrid_nixl.connector.launcher",
            "serve",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        kv_config = self.kv_transfer_config()
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        return args + self.extra_args + mamba_engine_args(self.model, self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        set_engine_keep_alive(env)
        set_mamba_environment(self.model, env)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(self.cores)
        if self.host.startswith("127."):
            # An engine on a loopback address talks only to peers on this machine: keep
            # UCX (NIXL's transport) on the loopback device too, instead of also trying the
            # machine's outward interfaces.
            env.setdefault("UCX_NET_DEVICES", "lo")
        env.update(self.env)
        return env


class EngineProcess:
    """One running ``vllm serve``; its output goes to ``log_path``."""

    def __init__(self, spec: EngineSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> EngineProcess:
        cores, usable = self.spec.cores, os.sched_getaffinity(0)
        if cores is not None and not set(cores) <= usable:
            raise EngineStartError(
                f"{self.spec.role} engine: cpu_core {cores} names cores this process may not "
                f"use; it may use {cpu_list(sorted(usable))} (its CPU affinity: a container's "
                "cpuset, taskset). Give cores from those, or none"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.spec.command(),
                env=self.spec.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches vLLM's children
                preexec_fn=partial(start_engine_child, cores),
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout_s: float = 300.0, progress: bool = True) -> None:
        """Poll ``/health`` until it answers 200; fail with the log tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        last_report = 0.0
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise EngineStartError(
                    f"{self.spec.role} engine on port {self.spec.port} exited with code {code} "
                    f"before it was healthy; last log lines ({self.log_path}):\n" + self.log_tail()
                )
            if answers_health(self.spec.url):
                return
            elapsed = time.monotonic() - started
            if progress and elapsed - last_report >= 10:
                last_report = elapsed
                print(
                    f"  waiting for {self.spec.role} engine on :{self.spec.port} "
                    f"({elapsed:.0f}s, log {self.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(1.0)
        raise EngineStartError(
            f"{self.spec.role} engine on port {self.spec.port} was not healthy after "
            f"{timeout_s:.0f}s; see {self.log_path}"
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the engine (by PID): SIGTERM to its API server, which drains (:mod:`.drain`
        of the connector) and stops its own engine-core and worker processes; SIGKILL to
        the whole process group after ``timeout_s``. When the API server is already gone
        (a crash, the OOM killer), vLLM's engine-core and worker processes may outlive it
        holding the engine's ports: they are killed too."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session made the child its group leader
        if self.process.poll() is not None:
            kill_leftover_group(pgid)
            return
        steps = ((os.kill, signal.SIGTERM, timeout_s), (os.killpg, signal.SIGKILL, 5.0))
        for send, sig, wait in steps:
            try:
                send(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        kill_leftover_group(pgid)


def stop_engines(engines: Iterable[EngineProcess], timeout_s: float = 20.0) -> None:
    """Stop several engines at once: each drains and shuts down (about 6 s for an idle one)
    while the others do, instead of one after another. Each is still stopped by its PID as
    :meth:`EngineProcess.stop` does; the first error, if any, is raised after all stopped."""
    engines = list(engines)
    if not engines:
        return
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        outcomes = [pool.submit(engine.stop, timeout_s) for engine in engines]
    for outcome in outcomes:
        outcome.result()
