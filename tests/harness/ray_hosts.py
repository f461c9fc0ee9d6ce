"""A Ray cluster across namespace hosts: the head in one host, a worker in each of the others.

Every raylet is started with ``ray start --block`` inside its host (so the node IP is that
host's own address and the process group is stopped with the host), under one temporary
directory of this cluster's own. Workers may be bound to cores (``taskset``), which the
deployment reads as the node's cores. ``wait_for_nodes`` polls the GCS from the head host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.netns_hosts import NetnsHost

GCS_PORT = 6379
RAY_START_TIMEOUT_S = 180.0
_LIST_NODES = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps([{"ip": n["NodeManagerAddress"], "alive": n["Alive"],
                   "resources": n["Resources"]} for n in ray.nodes()]))
"""


@dataclass
class WorkerSpec:
    host: NetnsHost
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    cores: Sequence[int] | None = None  # taskset for the raylet and everything it starts


@dataclass
class RayOnHosts:
    head: NetnsHost
    workers: list[WorkerSpec]
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rayh")))
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray refuses unauthenticated nodes off loopback: one token for every node and driver.
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self.token
        return env

    def _ray(self, host: NetnsHost, args: list[str], cores: Sequence[int] | None, log: str):
        ray_bin = str(Path(sys.executable).parent / "ray")
        argv = [ray_bin, "start", "--block", "--disable-usage-stats", *args]
        if cores is not None:
            argv = ["taskset", "-c", ",".join(str(c) for c in cores), *argv]
        out = open(self.temp_dir / log, "wb")  # noqa: SIM115 - kept open while the raylet runs
        return host.popen(argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT)

    def start(self) -> RayOnHosts:
        self._ray(
            self.head,
            [
                "--head",
                f"--node-ip-address={self.head.address}",
                f"--port={GCS_PORT}",
                "--num-cpus=0",
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dir}",
                "--object-store-memory=100000000",
            ],
            None,
            "head.log",
        )
        self.wait_for_nodes(1)
        # One raylet at a time: started together on two cores they time out registering.
        for index, worker in enumerate(self.workers):
            self._ray(
                worker.host,
                [
                    f"--address={self.address}",
                    f"--node-ip-address={worker.host.address}",
                    f"--num-cpus={worker.num_cpus}",
                    f"--resources={json.dumps(worker.resources)}",
                    "--object-store-memory=100000000",
                ],
                worker.cores,
                f"worker-{index}.log",
            )
            self.wait_for_nodes(2 + index)
        return self

    def nodes(self) -> list[dict]:
        done = self.head.run(
            [sys.executable, "-c", _LIST_NODES, self.address], timeout_s=60, env=self.env()
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def wait_for_nodes(self, count: int, timeout_s: float = RAY_START_TIMEOUT_S) -> None:
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            exited = [p.args for h in self._hosts() for p in h.processes if p.poll() is not None]
            if exited:
                last = f"exited: {exited}"
                break
            try:
                alive = [n for n in self.nodes() if n["alive"]]
                if len(alive) >= count:
                    return
                last = f"{len(alive)} of {count} nodes alive"
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
                last = str(exc)[-500:]
            time.sleep(2.0)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in self.temp_dir.glob("*.log")}
        raise RuntimeError(f"Ray cluster on {self.address} not up: {last}\n{logs}")

    def _hosts(self) -> list[NetnsHost]:
        return [self.head, *(w.host for w in self.workers)]

    def remove_temp_dir(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)
