"""Small network helpers."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

#: Ports at or above this stay clear of Ray's default worker ports (10002-19999).
LOWEST_PORT = 20000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_handed_out: set[tuple[str, int]] = set()
_lock = threading.Lock()
#: The OS's randomness: no two processes share its state (``random``'s can be seeded alike).
_random = random.SystemRandom()


def pick_range(ephemeral: tuple[int, int] | None) -> tuple[int, int] | None:
    """The ports to pick from: the wider side of ``ephemeral`` (the kernel's range for
    ``bind(0)`` and outgoing connections) at or above :data:`LOWEST_PORT`, at least 1000
    ports wide; None when there is no such side (then the kernel picks)."""
    if ephemeral is None:
        return None
    start, end = ephemeral
    sides = [(LOWEST_PORT, start - 1), (max(end + 1, LOWEST_PORT), 65535)]
    low, high = max(sides, key=lambda side: side[1] - side[0])
    return (low, high) if high - low >= 1000 else None


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range, when it can be read."""
    try:
        start, end = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(start), int(end)
    except (OSError, ValueError):
        return None


def can_bind(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now and that this process has not handed
    out before. It comes from outside the kernel's ephemeral range, so no other socket's
    ``bind(0)`` or outgoing connection can take it between this pick and the caller's bind
    (a port the kernel picked was seen taken by an engine's own sockets in that gap)."""
    ports = pick_range(ephemeral_range())
    with _lock:
        for _ in range(200 if ports else 0):
            port = _random.randint(*ports)
            if (host, port) not in _handed_out and can_bind(host, port):
                _handed_out.add((host, port))
                return port
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        _handed_out.add((host, port))
        return port


#: Ports our connector derives from an engine's NIXL side-channel port: the lease service
#: (+1000) and the KV digest services (+500 + TP rank). Ray Serve LLM gives decode replicas
#: prefill's side channel + 2000, so one engine's derived ports (+0, +500, +1000) never meet
#: the other's (+2000, +2500, +3000).
LEASE_PORT_OFFSET = 1000
DIGEST_PORT_OFFSET = 500
SIDE_CHANNEL_SPAN = LEASE_PORT_OFFSET + 64


def free_side_channel_port(host: str = "127.0.0.1") -> int:
    """A free side-channel port whose derived ports (lease +1000, digest +500 + rank) stay
    outside the kernel's ephemeral range too, so no outgoing connection can hold them when
    the engine binds; free right now at the port, +500 and +1000."""
    ports = pick_range(ephemeral_range())
    if ports is not None and ports[1] - SIDE_CHANNEL_SPAN - ports[0] >= 1000:
        low, high = ports[0], ports[1] - SIDE_CHANNEL_SPAN
        with _lock:
            for _ in range(200):
                port = _random.randint(low, high)
                offsets = (0, DIGEST_PORT_OFFSET, LEASE_PORT_OFFSET)
                candidates = [(host, port + offset) for offset in offsets]
                if not any(c in _handed_out for c in candidates) and all(
                    can_bind(h, p) for h, p in candidates
                ):
                    _handed_out.update(candidates)
                    return port
    return free_port(host)
