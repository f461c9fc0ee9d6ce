"""The separate-hosts fixture itself (``tests/harness/netns_hosts.py``): three network
namespaces on a bridge, each with its own address, reach one another over their veth
interfaces; a cut link stops traffic until it is restored; removal leaves no namespace, link
or process behind. Where namespaces cannot be made the test says so by name, and fails under
CI (``CI`` set) instead of skipping."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.harness.netns_hosts import NamespacesUnavailable, NetnsCluster

pytestmark = pytest.mark.integration

ECHO_PORT = 47011
ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(64).upper())
    """
)
ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as conn:
        conn.sendall(b"hello")
        print(conn.recv(64).decode())
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    made = NetnsCluster(3)
    try:
        made.create()
    except NamespacesUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"network namespaces are needed for the multi-host tests: {exc}")
        pytest.skip(f"network namespaces unavailable here: {exc}")
    try:
        yield made
    finally:
        made.remove()


def echo_from(cluster: NetnsCluster, client: int, server: int) -> str:
    done = cluster.hosts[client].run(
        [sys.executable, "-c", ECHO_CLIENT, cluster.hosts[server].address, str(ECHO_PORT)]
    )
    return done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()}"


def test_hosts_have_their_own_addresses_and_reach_each_other(cluster: NetnsCluster) -> None:
    first, second, third = cluster.hosts
    shown = first.run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
    assert f"inet {first.address}/24" in shown
    assert second.address not in first.run(["ip", "-o", "-4", "addr"]).stdout
    server = first.popen(
        [sys.executable, "-c", ECHO_SERVER, first.address, str(ECHO_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "listening"
    assert echo_from(cluster, 1, 0) == "HELLO"  # host 2 -> host 1 over the bridge
    assert echo_from(cluster, 2, 0) == "HELLO"
    with socket.create_connection((first.address, ECHO_PORT), timeout=3) as conn:  # the root
        conn.sendall(b"root")
        assert conn.recv(64) == b"ROOT"
    # Each host's loopback is its own: nothing listens on host 2's 127.0.0.1 port.
    local = third.run([sys.executable, "-c", ECHO_CLIENT, "127.0.0.1", str(ECHO_PORT)])
    assert local.returncode != 0


def test_a_cut_link_stops_traffic_until_it_is_restored(cluster: NetnsCluster) -> None:
    first = cluster.hosts[0]
    assert echo_from(cluster, 1, 0) == "HELLO"
    cluster.set_link(first, up=False)
    try:
        assert echo_from(cluster, 1, 0).startswith("failed")
    finally:
        cluster.set_link(first, up=True)
    assert echo_from(cluster, 1, 0) == "HELLO"


def test_removal_leaves_nothing_behind() -> None:
    made = NetnsCluster(2, offset=1).create()
    server = made.hosts[0].popen([sys.executable, "-c", ECHO_SERVER, made.hosts[0].address, "1"])
    assert made.existing(), "the namespaces and links exist while the cluster does"
    made.remove()
    assert made.existing() == []
    assert server.poll() is not None


UCX_DEVICE_OF_ENGINE = textwrap.dedent(
    """
    import os, sys
    os.environ.pop("UCX_NET_DEVICES", None)
    from vllm_hybrid_nixl.deploy.engines import EngineSpec
    spec = EngineSpec(model="m", port=8000, host=sys.argv[1])
    print(spec.environment().get("UCX_NET_DEVICES"))
    """
)


def test_only_a_loopback_engine_has_its_ucx_devices_chosen(cluster: NetnsCluster) -> None:
    """An engine on a host's own address leaves UCX free to pick its devices (naming the
    address's interface would shut out RDMA devices on a real cluster); one on a loopback
    address keeps UCX on ``lo``, where all its peers are."""
    host = cluster.hosts[1]
    done = host.run([sys.executable, "-c", UCX_DEVICE_OF_ENGINE, host.address])
    assert done.stdout.strip() == "None", done.stderr[-2000:]
    done = host.run([sys.executable, "-c", UCX_DEVICE_OF_ENGINE, "127.0.0.1"])
    assert done.stdout.strip() == "lo", done.stderr[-2000:]
