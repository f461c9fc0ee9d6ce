"""The lease protocol on the wire: one JSON request, one JSON reply, over ZeroMQ.

Request ``{"op": "pin" | "status", "epoch": E, "reqs": [prefill request ids]}``; reply
``{"epoch": E', "leases": {id: LeaseStatus}}``. ``epoch`` identifies one start of the prefill
engine: a reply from another epoch means the engine restarted under the same address, and
every request of the old one is treated as released. The server answers from the prefill
engine's :class:`~vllm_hybrid_nixl.protocol.lease_table.LeaseTable`; it exposes only lease states.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus, LeaseTable

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: The key our prefill engines add to ``kv_transfer_params``.
PARAMS_KEY = "hybrid_lease"
RESTARTED = "the prefill engine restarted after it prefilled this request"


@dataclass(frozen=True)
class LeaseAddress:
    """Where a prefill engine answers lease questions, and which start of it that was."""

    host: str
    port: int
    epoch: str

    def to_params(self) -> dict[str, object]:
        return {"host": self.host, "port": self.port, "epoch": self.epoch}

    @classmethod
    def from_params(cls, params: object) -> LeaseAddress | None:
        if not isinstance(params, dict):
            return None
        try:
            return cls(str(params["host"]), int(params["port"]), str(params["epoch"]))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class LeaseServer:
    """A daemon thread answering lease questions from ``table`` on ``host`` (port chosen
    free unless given)."""

    def __init__(self, table: LeaseTable, host: str, port: int = 0) -> None:
        self.table = table
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        bind_host = f"[{host}]" if ":" in host else host
        if port:
            self._socket.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = LeaseAddress(host, int(port), table.epoch)
        self._thread = threading.Thread(target=self._serve, name="hybrid-nixl-lease", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                raw = self._socket.recv()
            except zmq.ZMQError:
                return  # the context was terminated: the process is ending
            self._socket.send(json.dumps(self._answer(raw)).encode())

    def _answer(self, raw: bytes) -> dict[str, object]:
        try:
            request = json.loads(raw)
            op, reqs = request["op"], [str(r) for r in request["reqs"]]
        except (ValueError, KeyError, TypeError):
            return {"epoch": self.table.epoch, "error": "malformed lease request"}
        if request.get("epoch") != self.table.epoch:
            return {"epoch": self.table.epoch, "leases": {}}
        if op == "pin":
            answers = self.table.pin(reqs)
        else:
            answers = {r: self.table.status(r) for r in reqs}
        return {"epoch": self.table.epoch, "leases": {r: s.to_wire() for r, s in answers.items()}}


class LeaseUnreachable(ConnectionError):
    """The prefill engine did not answer the lease question in time."""


def ask(
    address: LeaseAddress, op: str, req_ids: Iterable[str], timeout_s: float = 2.0
) -> dict[str, LeaseStatus]:
    """Pin (``op="pin"``) or look up (``"status"``) leases; raises :class:`LeaseUnreachable`."""
    reqs = list(req_ids)
    context = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address.endpoint)
        socket.send(json.dumps({"op": op, "epoch": address.epoch, "reqs": reqs}).encode())
        if not socket.poll(int(timeout_s * 1000)):
            raise LeaseUnreachable(
                f"no answer from the prefill engine's lease service at {address.endpoint} "
                f"within {timeout_s:g} s"
            )
        reply = json.loads(socket.recv())
    finally:
        socket.close()
    if reply.get("epoch") != address.epoch:
        restarted = LeaseStatus(LeaseState.UNKNOWN, RESTARTED)
        return {r: restarted for r in reqs}
    leases = reply.get("leases", {})
    unknown = LeaseStatus(LeaseState.UNKNOWN)
    return {r: LeaseStatus.from_wire(leases[r]) if r in leases else unknown for r in reqs}
