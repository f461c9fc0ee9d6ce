"""The lease protocol on the wire: one JSON request, one JSON reply, over ZeroMQ.

Request ``{"op": "pin" | "renew" | "status", "epoch": E, "reqs": [prefill request ids],
"readers": {id: reader}}`` (``readers`` only for ``pin``); reply ``{"epoch": E', "leases":
{id: LeaseStatus}}`` or ``{"epoch": E', "error": text}``. ``epoch`` identifies one start of the
prefill engine: a reply from another epoch means the engine restarted under the same address,
and every request of the old one is treated as released. The server answers from the prefill
engine's :class:`~vllm_hybrid_nixl.protocol.lease_table.LeaseTable`; it exposes only lease
states. It answers anything it cannot use with an error and keeps serving: messages are
capped in size (ZeroMQ drops larger ones) and in ids, and no input reaches the table unchecked.
On the asking side every reply that is not this protocol is a :class:`LeaseAskFailed`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus, LeaseTable
from vllm_hybrid_nixl.protocol.reply_loop import serve_replies

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: The key our prefill engines add to ``kv_transfer_params``.
PARAMS_KEY = "hybrid_lease"
RESTARTED = "the prefill engine restarted after it prefilled this request"
OPS = ("pin", "renew", "status")
#: Largest message the service reads (ZeroMQ drops larger ones before they are parsed).
MAX_MESSAGE_BYTES = 64 * 1024
#: Most request ids one message may name.
MAX_IDS = 256
MAX_ID_CHARS = 256
_EPOCH = re.compile(r"^[0-9a-f]{1,64}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")


class LeaseParamsError(ValueError):
    """A ``hybrid_lease`` value that is not a usable lease address."""


def _checked_host(host: object) -> str:
    if not isinstance(host, str) or not host:
        raise LeaseParamsError(f"host must be a non-empty string, got {host!r:.80}")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        if _HOSTNAME.match(host):
            return host
    raise LeaseParamsError(f"host {host!r:.80} is neither an IP address nor a host name")


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
        """The address in a ``hybrid_lease`` value; None when it is not usable."""
        try:
            return cls.parse(params)
        except LeaseParamsError:
            return None

    @classmethod
    def parse(cls, params: object) -> LeaseAddress:
        """The address in a ``hybrid_lease`` value; raises :class:`LeaseParamsError` naming
        what is wrong with it."""
        if not isinstance(params, dict):
            raise LeaseParamsError(f"expected an object, got {type(params).__name__}")
        port, epoch = params.get("port"), params.get("epoch")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise LeaseParamsError(f"port must be an integer in 1..65535, got {port!r:.80}")
        if not isinstance(epoch, str) or not _EPOCH.match(epoch):
            raise LeaseParamsError(f"epoch must be a hex string, got {epoch!r:.80}")
        return cls(_checked_host(params.get("host")), port, epoch)

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
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        bind_host = f"[{host}]" if ":" in host else host
        try:
            if port:
                self._socket.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError:
            self._socket.close()
            raise
        self.address = LeaseAddress(host, int(port), table.epoch)
        self._thread = threading.Thread(target=self._serve, name="hybrid-nixl-lease", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        serve_replies(
            self._socket,
            self.answer,
            lambda exc: self._error(f"the lease service failed on this message: {exc!r:.200}"),
            "lease service",
        )

    def _error(self, message: str) -> dict[str, object]:
        return {"epoch": self.table.epoch, "error": message}

    def answer(self, raw: bytes) -> dict[str, object]:
        """The reply to one message (an ``error`` reply for anything malformed)."""
        try:
            request = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return self._error(f"not a JSON lease request ({type(exc).__name__})")
        problem = request_problem(request)
        if problem:
            logger.warning("vllm-hybrid-nixl: lease service refused a message: %s", problem)
            return self._error(problem)
        if request["epoch"] != self.table.epoch:
            return {"epoch": self.table.epoch, "leases": {}}
        op, reqs = request["op"], request["reqs"]
        if op == "pin":
            answers = self.table.pin(reqs, request.get("readers") or {})
        elif op == "renew":
            answers = self.table.renew(reqs)
        else:
            answers = {r: self.table.status(r) for r in reqs}
        return {"epoch": self.table.epoch, "leases": {r: s.to_wire() for r, s in answers.items()}}


def request_problem(request: object) -> str:
    """What is wrong with a parsed lease request (empty when nothing is)."""
    if not isinstance(request, dict):
        return f"a lease request must be a JSON object, got {type(request).__name__}"
    op, epoch, reqs = request.get("op"), request.get("epoch"), request.get("reqs")
    if op not in OPS:
        return f"op must be one of {', '.join(OPS)}, got {str(op)[:40]!r}"
    if not isinstance(epoch, str):
        return "epoch must be a string"
    if not isinstance(reqs, list) or not all(
        isinstance(r, str) and 0 < len(r) <= MAX_ID_CHARS for r in reqs
    ):
        return f"reqs must be a list of request ids (strings of 1..{MAX_ID_CHARS} characters)"
    if len(reqs) > MAX_IDS:
        return f"reqs names {len(reqs)} requests, more than {MAX_IDS} per message"
    readers = request.get("readers")
    if readers is not None and not (
        isinstance(readers, dict)
        and all(isinstance(v, str) and len(v) <= 2 * MAX_ID_CHARS for v in readers.values())
    ):
        return "readers must be an object of request id -> reader name"
    return ""


class LeaseAskFailed(ConnectionError):
    """The lease question got no usable answer (the message says why)."""


class LeaseUnreachable(LeaseAskFailed):
    """The prefill engine did not answer the lease question in time."""


class LeaseProtocolError(LeaseAskFailed):
    """The answer was not this protocol's (or the service refused the question)."""


class LeaseClient:
    """One persistent connection to one lease service endpoint (host and port, whatever
    start of the engine answers there), for one asker at a time (a lock serialises callers).
    A question that got no answer closes the connection, so the next one starts clean (a
    ZeroMQ REQ socket cannot send again before it received)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._socket: zmq.Socket | None = None
        self._lock = threading.Lock()

    def ask(
        self,
        address: LeaseAddress,
        op: str,
        req_ids: Iterable[str],
        timeout_s: float,
        readers: dict[str, str] | None = None,
    ) -> dict[str, LeaseStatus]:
        """As :func:`ask` (``address`` must be at this client's endpoint), over this
        client's connection."""
        reqs = list(req_ids)
        message = question(address, op, reqs, readers)
        where = f"the prefill engine's lease service at {self.endpoint}"
        timeout_s = max(float(timeout_s), 0.001)
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = zmq.Context.instance().socket(zmq.REQ)
                    self._socket.setsockopt(zmq.LINGER, 0)
                    self._socket.connect(self.endpoint)
                self._socket.send(message)
                if not self._socket.poll(int(timeout_s * 1000)):
                    self._close()
                    raise LeaseUnreachable(f"no answer from {where} within {timeout_s:g} s")
                raw = self._socket.recv()
            except zmq.ZMQError as exc:
                self._close()
                raise LeaseUnreachable(f"could not reach {where}: {exc}") from exc
        return read_reply(raw, address, reqs, where)

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        with self._lock:
            self._close()


def question(
    address: LeaseAddress, op: str, reqs: list[str], readers: dict[str, str] | None = None
) -> bytes:
    """One lease question on the wire: ``op`` on ``reqs`` (pins name their ``readers``)."""
    message: dict[str, object] = {"op": op, "epoch": address.epoch, "reqs": reqs}
    if readers:
        message["readers"] = readers
    return json.dumps(message).encode()


def ask(
    address: LeaseAddress,
    op: str,
    req_ids: Iterable[str],
    timeout_s: float = 2.0,
    readers: dict[str, str] | None = None,
) -> dict[str, LeaseStatus]:
    """Pin, renew or look up leases over a connection of its own; raises
    :class:`LeaseAskFailed` (never anything else) when no usable answer came."""
    client = LeaseClient(address.endpoint)
    try:
        return client.ask(address, op, req_ids, timeout_s, readers)
    finally:
        client.close()


def read_reply(
    raw: bytes, address: LeaseAddress, reqs: list[str], where: str
) -> dict[str, LeaseStatus]:
    """The statuses in a reply; raises :class:`LeaseProtocolError` for anything else."""
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LeaseProtocolError(f"{where} answered something that is not JSON") from exc
    if not isinstance(reply, dict):
        raise LeaseProtocolError(f"{where} answered a {type(reply).__name__}, not an object")
    if reply.get("epoch") != address.epoch:
        restarted = LeaseStatus(LeaseState.UNKNOWN, RESTARTED)
        return {r: restarted for r in reqs}
    if "error" in reply:
        raise LeaseProtocolError(f"{where} refused the question: {str(reply['error'])[:300]}")
    leases = reply.get("leases")
    if not isinstance(leases, dict):
        raise LeaseProtocolError(f"{where} answered without lease states")
    unknown = LeaseStatus(LeaseState.UNKNOWN)
    try:
        return {r: LeaseStatus.from_wire(leases[r]) if r in leases else unknown for r in reqs}
    except ValueError as exc:
        raise LeaseProtocolError(f"{where} answered an unusable lease state: {exc}") from exc
