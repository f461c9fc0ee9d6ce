"""The decode engine's lease traffic, off the engine's step: pins and renewals run on
background threads over one persistent connection per prefill lease endpoint, so a lease
service that does not answer delays only the requests that need it, never the engine's
other streams. Pins waiting for one endpoint go out together in one question."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus
from vllm_hybrid_nixl.protocol.lease_wire import (
    MAX_IDS,
    LeaseAddress,
    LeaseClient,
    LeaseUnreachable,
)

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: Renewals of waiting decode requests' leases: at most this often, at least 3 per lease.
RENEW_EVERY_S = 1.0
#: Tries of a pin whose lease service did not answer in time before it is refused: an engine
#: core starved of its core for a moment must not fail a request (each try waits up to
#: ``lease_check_timeout``; a pin repeated by the same reader only renews it).
PIN_ATTEMPTS = 3
#: Lease endpoints with a connection (and a thread) kept at once; the least recently used
#: one is closed beyond this.
MAX_PEERS = 64

T = TypeVar("T")


def _failed(exc: BaseException) -> LeaseStatus:
    return LeaseStatus(LeaseState.UNKNOWN, f"the lease question failed: {exc!r:.300}")


class LeasePeers:
    """A persistent client and a one-thread queue per lease endpoint: questions to one
    endpoint run in order, to different endpoints in parallel."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, tuple[LeaseClient, ThreadPoolExecutor]] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, endpoint: str, job: Callable[[LeaseClient], T]) -> Future[T]:
        """``job(client)`` on the endpoint's thread."""
        for _ in range(3):
            client, executor = self._peer(endpoint)
            try:
                return executor.submit(job, client)
            except RuntimeError:  # evicted between lookup and submit: look up again
                continue
        raise RuntimeError(f"could not queue a lease question for {endpoint}")

    def _peer(self, endpoint: str) -> tuple[LeaseClient, ThreadPoolExecutor]:
        evicted = []
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                executor = ThreadPoolExecutor(1, thread_name_prefix="hybrid-nixl-lease")
                peer = (LeaseClient(endpoint), executor)
                self._peers[endpoint] = peer
                while len(self._peers) > MAX_PEERS:
                    evicted.append(self._peers.popitem(last=False)[1])
            self._peers.move_to_end(endpoint)
        for old_client, old_executor in evicted:  # queued questions still run; then closed
            old_executor.submit(old_client.close)
            old_executor.shutdown(wait=False)
        return peer


class Pinner:
    """Pins decode requests' leases in the background; each future's result is the lease
    status (a failed question is an ``UNKNOWN`` status naming why, never an exception)."""

    def __init__(self, peers: LeasePeers, timeout_s: float) -> None:
        self._peers, self._timeout_s = peers, timeout_s
        self._pending: dict[LeaseAddress, list[tuple[str, str, Future[LeaseStatus]]]] = defaultdict(
            list
        )
        self._draining: set[LeaseAddress] = set()
        self._lock = threading.Lock()

    def submit(self, address: LeaseAddress, remote_req: str, reader: str) -> Future[LeaseStatus]:
        future: Future[LeaseStatus] = Future()
        with self._lock:
            self._pending[address].append((remote_req, reader, future))
            start = address not in self._draining
            self._draining.add(address)
        if start:
            try:
                self._peers.run(address.endpoint, lambda client: self._drain(client, address))
            except RuntimeError as exc:
                self._fail_all(address, exc)
        return future

    def _fail_all(self, address: LeaseAddress, exc: BaseException) -> None:
        with self._lock:
            batch = self._pending.pop(address, [])
            self._draining.discard(address)
        for _, _, future in batch:
            future.set_result(_failed(exc))

    def _drain(self, client: LeaseClient, address: LeaseAddress) -> None:
        """Pin everything pending for ``address``, one question per batch of ids."""
        while True:
            with self._lock:
                batch = self._pending[address][:MAX_IDS]
                del self._pending[address][: len(batch)]
                if not batch:
                    del self._pending[address]
                    self._draining.discard(address)
                    return
            readers = {remote_req: reader for remote_req, reader, _ in batch}
            started = time.monotonic()
            try:
                answers = self._pin_with_retries(client, address, readers)
            except Exception as exc:  # noqa: BLE001 - every failure is a refusal, by name
                logger.warning(
                    "vllm-hybrid-nixl: pinning %d lease(s) at %s failed after %.0f ms: %s",
                    len(batch),
                    address.endpoint,
                    (time.monotonic() - started) * 1e3,
                    exc,
                )
                for _, _, future in batch:
                    future.set_result(_unknown(str(exc)) if str(exc) else _failed(exc))
                continue
            for remote_req, _, future in batch:
                future.set_result(answers.get(remote_req, LeaseStatus(LeaseState.UNKNOWN)))

    def _pin_with_retries(
        self, client: LeaseClient, address: LeaseAddress, readers: dict[str, str]
    ) -> dict[str, LeaseStatus]:
        for attempt in range(1, PIN_ATTEMPTS + 1):
            try:
                return client.ask(address, "pin", list(readers), self._timeout_s, readers)
            except LeaseUnreachable as exc:
                if attempt == PIN_ATTEMPTS:
                    raise LeaseUnreachable(f"{exc} ({PIN_ATTEMPTS} tries)") from exc
                logger.warning(
                    "vllm-hybrid-nixl: pin at %s, try %d of %d: %s",
                    address.endpoint,
                    attempt,
                    PIN_ATTEMPTS,
                    exc,
                )
        raise AssertionError("unreachable")  # the loop returns or raises


def _unknown(reason: str) -> LeaseStatus:
    return LeaseStatus(LeaseState.UNKNOWN, reason)


class LeaseRenewer:
    """A daemon thread that renews the leases of decode requests that still want their
    blocks (queued, waiting for blocks, reading), so a busy decode engine never lets a
    prefill engine release them; a renewal answered "no longer readable" is kept for the
    scheduler (:meth:`take_lost`), which then refuses the read. Each acknowledged renewal
    also says until when the blocks are surely held (:meth:`held_until`): the prefill
    engine extended the lease by ``lease_s`` after the question was sent."""

    def __init__(self, peers: LeasePeers, timeout_s: float) -> None:
        self._peers, self._timeout_s = peers, timeout_s
        self._waiting: dict[str, tuple[LeaseAddress, str, float]] = {}
        self._lost: dict[str, LeaseStatus] = {}
        self._held: dict[str, float] = {}
        self._in_flight: dict[LeaseAddress, Future[None]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, decode_req: str, address: LeaseAddress, remote_req: str, lease_s: float) -> None:
        with self._lock:
            self._waiting[decode_req] = (address, remote_req, lease_s)
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name="hybrid-nixl-lease-renewer", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError:
                    logger.exception("vllm-hybrid-nixl: the lease renewer could not start")
                    return  # tried again with the next request
                self._thread = thread

    def drop(self, decode_req: str) -> None:
        with self._lock:
            self._waiting.pop(decode_req, None)
            self._lost.pop(decode_req, None)
            self._held.pop(decode_req, None)

    def lost(self, decode_req: str) -> bool:
        """Whether a renewal found ``decode_req``'s lease ended (kept for :meth:`take_lost`)."""
        with self._lock:
            return decode_req in self._lost

    def held_until(self, decode_req: str) -> float | None:
        """The latest time (``time.monotonic``) until which an acknowledged renewal keeps
        ``decode_req``'s blocks held; None before any."""
        with self._lock:
            return self._held.get(decode_req)

    def take_lost(self, decode_req: str) -> LeaseStatus | None:
        """The status that ended ``decode_req``'s lease, if a renewal found it ended."""
        with self._lock:
            return self._lost.pop(decode_req, None)

    def _run(self) -> None:
        while True:
            try:
                every = self._renew_round()
            except Exception:  # noqa: BLE001 - the renewer must outlive any one round
                logger.exception("vllm-hybrid-nixl: a lease renewal round failed")
                every = RENEW_EVERY_S
            time.sleep(every)

    def _renew_round(self) -> float:
        with self._lock:
            snapshot = list(self._waiting.items())
        by_address: dict[LeaseAddress, dict[str, list[str]]] = defaultdict(
            lambda: defaultdict(list)
        )
        every = RENEW_EVERY_S
        for decode_req, (address, remote_req, lease_s) in snapshot:
            by_address[address][remote_req].append(decode_req)
            every = min(every, max(lease_s / 3, 0.1))
        for address, readers in by_address.items():
            previous = self._in_flight.get(address)
            if previous is not None and not previous.done():
                continue  # that engine is slow to answer: no pile-up behind it
            self._in_flight[address] = self._peers.run(
                address.endpoint, lambda client, a=address, r=readers: self._renew(client, a, r)
            )
        for address in [a for a in self._in_flight if a not in by_address]:
            del self._in_flight[address]
        return every

    def _renew(
        self, client: LeaseClient, address: LeaseAddress, readers: dict[str, list[str]]
    ) -> None:
        remote_reqs = list(readers)
        for start in range(0, len(remote_reqs), MAX_IDS):
            sent = time.monotonic()
            try:
                answers = client.ask(
                    address, "renew", remote_reqs[start : start + MAX_IDS], self._timeout_s
                )
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                logger.warning("vllm-hybrid-nixl: lease renewal failed: %s", exc)
                return
            with self._lock:
                for remote_req, status in answers.items():
                    if status.readable and status.lease_s > 0:
                        for decode_req in readers.get(remote_req, ()):
                            if decode_req in self._waiting:
                                held = sent + status.lease_s
                                self._held[decode_req] = max(self._held.get(decode_req, 0), held)
                    if status.state in (LeaseState.RELEASED, LeaseState.UNKNOWN):
                        for decode_req in readers.get(remote_req, ()):
                            if decode_req in self._waiting:
                                self._lost[decode_req] = status
