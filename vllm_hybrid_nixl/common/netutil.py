"""Small network helpers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (``lo`` for
    127.0.0.1), or None when no interface does (a host name, another machine's address)."""
    import psutil  # vLLM's own dependency; imported here to keep this module light

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None
