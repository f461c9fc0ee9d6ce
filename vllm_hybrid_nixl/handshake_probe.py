"""Ask a running engine's NIXL side channel for the compatibility string it hands peers.

The side channel is the ZMQ socket vLLM's NIXL connector serves handshakes on
(``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``). A request is the msgpack tuple
``(b"get_meta_msg", pp_rank, tp_rank)`` (vLLM 0.26+) or ``(b"get_meta_msg", tp_rank)``
(0.24-0.25) -- the engine's listener thread dies on the other form, so the form must match
the engines' release; the first frame of the reply is the handshake payload, whose
``compatibility_hash`` is a layout fingerprint when the engine runs HybridNixlConnector and
a plain hex digest when it runs the stock connector. vLLM is imported only to pick the
request form (the newest form when vLLM is not installed).
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

GET_META_MSG = b"get_meta_msg"


class ProbeError(RuntimeError):
    """The side channel did not answer, or answered something that is not a NIXL handshake."""


def _compat_string(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("compatibility_hash"), str):
        return payload["compatibility_hash"]
    if isinstance(payload, list | tuple) and payload and isinstance(payload[0], str):
        return payload[0]
    raise ProbeError("the reply is not a NIXL handshake payload")


def _wants_pp_rank() -> bool:
    try:
        from vllm_hybrid_nixl import compat

        return compat.side_channel_wants_pp_rank()
    except Exception:  # no (supported) vLLM here: speak the newest form
        return True


def fetch_compat_string(
    host: str,
    port: int,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    timeout_s: float = 5.0,
    with_pp_rank: bool | None = None,
) -> str:
    """The compatibility string engine ``host:port`` sends in its NIXL handshake."""
    where = f"tcp://{host}:{port}"
    if with_pp_rank is None:
        with_pp_rank = _wants_pp_rank()
    request = (GET_META_MSG, pp_rank, tp_rank) if with_pp_rank else (GET_META_MSG, tp_rank)
    context = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(where)
        socket.send(msgspec.msgpack.encode(request))
        frames = socket.recv_multipart()
    except zmq.Again as exc:
        raise ProbeError(
            f"NIXL side channel {where} did not answer within {timeout_s:.0f} s; is the engine "
            "up, and are VLLM_NIXL_SIDE_CHANNEL_HOST/PORT the values given here?"
        ) from exc
    finally:
        socket.close()
    try:
        payload = msgspec.msgpack.decode(frames[0])
    except msgspec.DecodeError as exc:
        raise ProbeError(f"NIXL side channel {where} answered something undecodable") from exc
    return _compat_string(payload)
