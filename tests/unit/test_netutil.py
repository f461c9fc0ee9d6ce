"""free_port: ports from outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from vllm_hybrid_nixl.common.netutil import LOWEST_PORT, ephemeral_range, free_port, pick_range

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("ephemeral", "expected"),
    [
        ((32768, 60999), (LOWEST_PORT, 32767)),  # Linux's default
        ((1024, 50000), (50001, 65535)),
        ((20500, 65535), None),  # no side 1000 ports wide: the kernel picks
        (None, None),
    ],
)
def test_the_range_lies_outside_the_ephemeral_ports(ephemeral, expected) -> None:
    assert pick_range(ephemeral) == expected


def test_ports_are_bindable_distinct_and_outside_this_kernels_ephemeral_range() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    ephemeral = ephemeral_range()
    low_high = pick_range(ephemeral)
    if low_high is not None:
        assert all(low_high[0] <= port <= low_high[1] for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # still free: nothing took it


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch) -> None:
    from vllm_hybrid_nixl.common import netutil

    given = free_port()
    with socket.socket() as holder:  # a port some other program holds
        holder.bind(("127.0.0.1", 0))
        held = holder.getsockname()[1]
        spare = next(
            port
            for port in range(LOWEST_PORT, 65536)
            if ("127.0.0.1", port) not in netutil._handed_out
            and netutil.can_bind("127.0.0.1", port)
        )
        candidates = iter([held, given, spare])
        monkeypatch.setattr(netutil._random, "randint", lambda low, high: next(candidates))
        monkeypatch.setattr(netutil, "pick_range", lambda ephemeral: (1, 65535))
        assert free_port() == spare


def test_a_side_channel_port_keeps_its_derived_ports_free_outside_the_ephemeral_range() -> None:
    """The lease (+1000) and digest (+500 + rank) ports an engine derives from its side
    channel must not fall where outgoing connections take ports."""
    from vllm_hybrid_nixl.common.netutil import (
        DIGEST_PORT_OFFSET,
        LEASE_PORT_OFFSET,
        SIDE_CHANNEL_SPAN,
        can_bind,
        free_side_channel_port,
    )

    ephemeral = ephemeral_range()
    for _ in range(20):
        port = free_side_channel_port()
        for derived in (port, port + DIGEST_PORT_OFFSET, port + LEASE_PORT_OFFSET):
            assert can_bind("127.0.0.1", derived)
        if ephemeral is not None:
            start, end = ephemeral
            assert port + SIDE_CHANNEL_SPAN < start or port > end


def test_derived_ports_of_ray_serve_neighbours_never_meet() -> None:
    """Ray Serve LLM numbers decode replicas' side channels from prefill's + 2000 (its
    NIXL_SIDE_CHANNEL_PORT_BASE 20000 / 22000): no port one engine derives (side channel,
    digest ports for up to 64 TP ranks, lease) may be one the other derives (with +3000 the
    prefill's digest port was the decode's lease port, and whichever bound first won)."""
    from vllm_hybrid_nixl.common.netutil import DIGEST_PORT_OFFSET, LEASE_PORT_OFFSET

    def derived(side: int, ranks: int = 64) -> set[int]:
        digests = {side + DIGEST_PORT_OFFSET + rank for rank in range(ranks)}
        return {side + rank for rank in range(ranks)} | digests | {side + LEASE_PORT_OFFSET}

    assert not derived(20000) & derived(22000)
    assert len(derived(20000)) == 2 * 64 + 1
