"""Separate network hosts on one machine: Linux network namespaces on one bridge.

Each host is a namespace with its own ``lo`` and one veth interface (``eth0``) addressed
``10.<net>.0.<i>`` on a bridge in the root namespace (which itself takes ``.254``, so the
test process reaches every host through a real interface, never loopback). Everything is
named after this process's PID, so concurrent runs never collide, and :meth:`remove` deletes
exactly what :meth:`create` made (processes first, by PID, then namespaces, then the bridge),
also after a failure half way. Needs root (CI runs as root) and iproute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces here (not root, no iproute2, refused)."""


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


@dataclass
class NetnsHost:
    """One host: its namespace, its address on the bridge, the processes started in it."""

    namespace: str
    address: str
    veth: str  # the root-namespace end of its link (``ip link set VETH down`` cuts it)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this host (own session, so its children are stopped with it)."""
        process = subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout_s, env=env
        )

    def terminate_processes(self) -> None:
        """SIGTERM each process group started here (``stop_processes`` waits for them)."""
        for process in self.processes:
            if process.poll() is None:
                with _no_such_process():
                    os.killpg(process.pid, signal.SIGTERM)

    def stop_processes(self, grace_s: float = 20.0) -> None:
        """SIGTERM each process group started here, then SIGKILL what is left."""
        self.terminate_processes()
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with _no_such_process():
                os.killpg(process.pid, signal.SIGKILL)  # the group: children too
            if process.poll() is None:
                process.wait(timeout=10)
        self.processes.clear()


@contextmanager
def _no_such_process() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


@dataclass
class NetnsCluster:
    """``count`` hosts on one bridge, subnet ``10.<net>.0.0/24``; ``net`` defaults to one
    derived from this process's PID plus ``offset``, so two test runs on one machine (and
    two clusters in one run, by offset) never share a subnet."""

    count: int
    offset: int = 0
    net: int = -1
    hosts: list[NetnsHost] = field(default_factory=list)
    _made: list[tuple[str, str]] = field(default_factory=list)  # (kind, name), in order

    def __post_init__(self) -> None:
        if self.net < 0:
            self.net = 100 + (os.getpid() + self.offset) % 150

    @property
    def tag(self) -> str:
        """Prefix of every name made (interface names stay under Linux's 15 characters)."""
        return f"vhn{os.getpid() % 100000}n{self.net}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where the test process talks from)."""
        return f"10.{self.net}.0.254"

    def create(self) -> NetnsCluster:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NamespacesUnavailable(
                "network namespaces need root and iproute2's `ip` (CI runs as root)"
            )
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index in range(1, self.count + 1):
                self.hosts.append(self._add_host(index))
        except BaseException:
            self.remove()
            raise
        return self

    def _add_host(self, index: int) -> NetnsHost:
        namespace, veth = f"{self.tag}h{index}", f"{self.tag}v{index}"
        address = f"10.{self.net}.0.{index}"
        _ip("netns", "add", namespace)
        self._made.append(("netns", namespace))
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        self._made.append(("link", veth))
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("addr", "add", f"{address}/24", "dev", "eth0", namespace=namespace)
        _ip("link", "set", "eth0", "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        _ip("route", "add", "default", "via", self.gateway, namespace=namespace)
        return NetnsHost(namespace, address, veth)

    def set_link(self, host: NetnsHost, up: bool) -> None:
        """Cut (``up=False``) or restore ``host``'s only link to the others."""
        _ip("link", "set", host.veth, "up" if up else "down")

    def remove(self) -> None:
        """Stops every process started in a host, then deletes what ``create`` made."""
        for host in self.hosts:  # every host's grace period runs at once
            host.terminate_processes()
        for host in self.hosts:
            host.stop_processes()
        for kind, name in self._made:  # anything still in a host (a child that left its group)
            if kind == "netns":
                _kill_namespace_pids(name)
        for kind, name in reversed(self._made):
            args = ("netns", "del", name) if kind == "netns" else ("link", "del", name)
            subprocess.run(["ip", *args], capture_output=True, timeout=30)
        self._made.clear()
        self.hosts.clear()

    def existing(self) -> list[str]:
        """Namespaces and links of this cluster's tag that exist now (empty after remove)."""
        shown = "".join(
            subprocess.run(command, capture_output=True, text=True).stdout
            for command in (["ip", "-o", "link", "show"], ["ip", "netns", "list"])
        )
        return sorted({w.split("@")[0].rstrip(":") for w in shown.split() if self.tag in w})


def namespace_pids(namespace: str) -> list[int]:
    """PIDs of the processes running in ``namespace`` now (``ip netns pids``)."""
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_namespace_pids(namespace: str) -> None:
    for pid in namespace_pids(namespace):
        with _no_such_process():
            os.kill(pid, signal.SIGKILL)


@contextmanager
def netns_cluster(count: int, offset: int = 0) -> Iterator[NetnsCluster]:
    cluster = NetnsCluster(count, offset).create()
    try:
        yield cluster
    finally:
        cluster.remove()
