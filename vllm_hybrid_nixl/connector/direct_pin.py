"""Pins asked and answered on the decode scheduler's own thread.

A pin asked as a request arrives must be answered before the request's first ``schedule()``
(about a millisecond later) or the request waits a whole engine step. Through the background
:class:`~.lease_background.Pinner` the question first waits for a thread handoff: measured at
32 concurrent requests on two busy cores, the question left ~1 ms after arrival and 67-79 %
of requests missed their first ``schedule()``. Here the scheduler thread sends the question
itself (a non-blocking ZeroMQ send) and reads the answer without waiting when it next looks
(``get_num_new_matched_tokens``), so no other thread is involved. On with ``direct_pins``
(off by default): it raised the share of requests whose pin was answered at their first
``schedule()`` from 35 % to 78 %, but output tokens/s measured 0.92x with it over ten
alternating rounds on two cores (``bench.connector_ab``), for a reason not found.

Each lease endpoint has one REQ socket with at most one question in flight; a pin asked while
it is busy returns None (the caller uses the background pinner). A question unanswered after
``timeout_s`` closes its socket and is handed to the background pinner, which asks again (its
own tries, so a silent service is refused after one try here and the pinner's); a question
whose request has gone (:meth:`DirectPins.abandon`) is not. An answer that is not the
protocol's is a refusal naming why, never an exception. Not thread-safe: only the scheduler
thread calls it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import zmq

from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus
from vllm_hybrid_nixl.protocol.lease_wire import (
    LeaseAddress,
    LeaseAskFailed,
    question,
    read_reply,
)

#: Lease endpoints with a socket kept at once (least recently used closed beyond this).
MAX_ENDPOINTS = 64
#: Largest answer taken (an answer about one pin is ~200 bytes; the endpoint comes from the
#: request's parameters, so a larger one is dropped by ZeroMQ, not parsed on this thread).
MAX_ANSWER_BYTES = 64 * 1024

#: ``fallback(address, remote_req, reader)``: the background pinner's future for a pin.
Fallback = Callable[[LeaseAddress, str, str], "Future[LeaseStatus]"]


@dataclass
class _Asked:
    address: LeaseAddress
    remote_req: str
    reader: str
    sent: float
    future: Future[LeaseStatus] = field(default_factory=Future)
    abandoned: bool = False  # its request is gone: no one waits for the answer


class DirectPins:
    """Pin questions sent and answered on the calling (scheduler) thread."""

    def __init__(self, timeout_s: float, fallback: Fallback) -> None:
        self._timeout_s = max(float(timeout_s), 0.001)
        self._fallback = fallback
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._asked: dict[str, _Asked] = {}  # endpoint -> its question in flight

    def ask(
        self, address: LeaseAddress, remote_req: str, reader: str
    ) -> Future[LeaseStatus] | None:
        """Send the pin question now; its future, or None while this endpoint's socket has a
        question in flight (or cannot send at once)."""
        endpoint = address.endpoint
        self.collect()
        if endpoint in self._asked:
            return None
        try:
            socket = self._socket(endpoint)
            socket.send(question(address, "pin", [remote_req], {remote_req: reader}), zmq.NOBLOCK)
        except zmq.Again:  # ZeroMQ cannot queue it now: the socket stays, ready to send
            return None
        except zmq.ZMQError:
            self._close(endpoint)
            return None
        asked = _Asked(address, remote_req, reader, time.monotonic())
        self._asked[endpoint] = asked
        return asked.future

    def abandon(self, future: Future[LeaseStatus] | None) -> None:
        """``future``'s request has gone: its question, if still in flight, is not asked
        again when its time runs out (its answer, if one comes, is dropped)."""
        for asked in self._asked.values():
            if asked.future is future:
                asked.abandoned = True

    def in_flight(self) -> int:
        """Questions sent and not yet settled."""
        return len(self._asked)

    def collect(self) -> None:
        """Settle every question whose answer is in (or whose time ran out); never waits."""
        if not self._asked:
            return
        now = time.monotonic()
        for endpoint, asked in list(self._asked.items()):
            socket = self._sockets.get(endpoint)
            try:
                raw = socket.recv(zmq.NOBLOCK) if socket is not None else None
            except zmq.Again:
                raw = None
            except zmq.ZMQError as exc:
                self._hand_over(endpoint, f"the lease socket failed: {exc}")
                continue
            if raw is not None:
                del self._asked[endpoint]
                asked.future.set_result(self._status(raw, asked, endpoint))
            elif now - asked.sent > self._timeout_s:
                self._hand_over(endpoint, f"no answer within {self._timeout_s:g} s")

    def _status(self, raw: bytes, asked: _Asked, endpoint: str) -> LeaseStatus:
        where = f"the prefill engine's lease service at {endpoint}"
        try:
            answers = read_reply(raw, asked.address, [asked.remote_req], where)
        except LeaseAskFailed as exc:
            return LeaseStatus(LeaseState.UNKNOWN, str(exc))
        except Exception as exc:  # noqa: BLE001 - a reply that breaks the parser is refused
            return LeaseStatus(LeaseState.UNKNOWN, f"unreadable lease answer: {exc!r:.200}")
        return answers.get(asked.remote_req, LeaseStatus(LeaseState.UNKNOWN))

    def _hand_over(self, endpoint: str, why: str) -> None:
        """The question goes to the background pinner (which asks again); this socket,
        which cannot send again before it receives, is closed."""
        asked = self._asked.pop(endpoint)
        self._close(endpoint)
        first = f"asked from the scheduler's thread: {why}"
        if asked.abandoned:
            asked.future.set_result(LeaseStatus(LeaseState.UNKNOWN, f"{first}; request gone"))
            return
        try:
            later = self._fallback(asked.address, asked.remote_req, asked.reader)
        except Exception as exc:  # noqa: BLE001 - a pin that cannot be asked is refused
            asked.future.set_result(LeaseStatus(LeaseState.UNKNOWN, f"{first}; {exc!r:.200}"))
            return

        def settle(done: Future[LeaseStatus]) -> None:
            try:
                status = done.result()
            except BaseException as exc:  # noqa: BLE001 - the request must not wait forever
                status = LeaseStatus(LeaseState.UNKNOWN, f"the pin failed: {exc!r:.200}")
            if status.state is LeaseState.UNKNOWN and status.reason:  # say both tries
                status = replace(status, reason=f"{first}; then {status.reason}")
            asked.future.set_result(status)

        later.add_done_callback(settle)

    def _socket(self, endpoint: str) -> zmq.Socket:
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = zmq.Context.instance().socket(zmq.REQ)
            try:
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
                socket.connect(endpoint)
            except zmq.ZMQError:
                socket.close()
                raise
            self._sockets[endpoint] = socket
            while len(self._sockets) > MAX_ENDPOINTS:
                oldest = next(iter(self._sockets))
                if oldest in self._asked:
                    self._hand_over(oldest, "its socket was closed for newer endpoints")
                else:
                    self._close(oldest)
        self._sockets.move_to_end(endpoint)
        return socket

    def _close(self, endpoint: str) -> None:
        socket = self._sockets.pop(endpoint, None)
        if socket is not None:
            socket.close()
