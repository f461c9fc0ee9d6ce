"""Ask a running engine's NIXL side channel for the compatibility string it hands peers.

The side channel is the ZMQ socket vLLM's NIXL connector serves handshakes on
(``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``). A request is the msgpack tuple
``(b"get_meta_msg", pp_rank, tp_rank)`` (vLLM 0.26+) or ``(b"get_meta_msg", tp_rank)``
(0.24-0.25) -- the engine's listener thread dies on the other form, so the form must match
the engines' release; the first frame of the reply is the handshake payload, whose
``compatibility_hash`` is a layout fingerprint when the engine runs HybridNixlConnector and
a plain hex digest when it runs the stock connector. The caller says which form to speak:
the engine's own release decides (:func:`speaks_pp_rank_form`); nothing here imports vLLM.
"""

from __future__ import annotations

import re
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


#: First vLLM release whose side channel takes ``(msg, pp_rank, tp_rank)``.
PP_RANK_FORM_SINCE = (0, 26)


def speaks_pp_rank_form(vllm_version: str) -> bool:
    """Whether an engine of vLLM ``vllm_version`` (e.g. ``0.32.0+cpu``) expects the
    ``(msg, pp_rank, tp_rank)`` request; raises ValueError for an unreadable version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", vllm_version)
    if match is None:
        raise ValueError(f"not a vLLM version: {vllm_version!r}")
    return (int(match[1]), int(match[2])) >= PP_RANK_FORM_SINCE


def fetch_compat_string(
    host: str,
    port: int,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    timeout_s: float = 5.0,
    with_pp_rank: bool,
) -> str:
    """The compatibility string engine ``host:port`` sends in its NIXL handshake, asked in
    the form its release speaks (``with_pp_rank``: :func:`speaks_pp_rank_form`)."""
    where = f"tcp://{host}:{port}"
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
    except zmq.ZMQError as exc:
        raise ProbeError(f"NIXL side channel {where} could not be asked: {exc}") from exc
    finally:
        socket.close()
    try:
        payload = msgspec.msgpack.decode(frames[0])
    except msgspec.DecodeError as exc:
        raise ProbeError(f"NIXL side channel {where} answered something undecodable") from exc
    return _compat_string(payload)
