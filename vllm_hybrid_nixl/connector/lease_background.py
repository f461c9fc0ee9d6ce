"""The decode engine's lease traffic, off the engine's step: pins and renewals run on
background threads over one persistent connection per prefill engine, so a lease service that
does not answer delays only the requests that need it, never the engine's other streams."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus
from vllm_hybrid_nixl.protocol.lease_wire import MAX_IDS, LeaseAddress, LeaseAskFailed, LeaseClient

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: Renewals of waiting decode requests' leases: at most this often, at least 3 per lease.
RENEW_EVERY_S = 1.0
#: Prefill engines with a connection (and a pin thread) kept at once; the least recently
#: used one is closed beyond this.
MAX_PEERS = 64


class LeasePeers:
    """A persistent client and a one-thread pin queue per prefill engine's lease service:
    pins to one engine run in order, pins to different engines in parallel."""

    def __init__(self) -> None:
        self._peers: OrderedDict[LeaseAddress, tuple[LeaseClient, ThreadPoolExecutor]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, address: LeaseAddress) -> tuple[LeaseClient, ThreadPoolExecutor]:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                executor = ThreadPoolExecutor(1, thread_name_prefix="hybrid-nixl-pin")
                peer = (LeaseClient(address), executor)
                self._peers[address] = peer
                while len(self._peers) > MAX_PEERS:
                    _, (old_client, old_executor) = self._peers.popitem(last=False)
                    old_executor.shutdown(wait=False)
                    old_client.close()
            self._peers.move_to_end(address)
            return peer


class Pinner:
    """Pins one decode request's lease in the background; the future's result is the lease
    status (a failed ask is an ``UNKNOWN`` status naming why, never an exception)."""

    def __init__(self, peers: LeasePeers, timeout_s: float) -> None:
        self._peers, self._timeout_s = peers, timeout_s

    def submit(self, address: LeaseAddress, remote_req: str, reader: str) -> Future[LeaseStatus]:
        client, executor = self._peers.get(address)
        return executor.submit(self._pin, client, remote_req, reader)

    def _pin(self, client: LeaseClient, remote_req: str, reader: str) -> LeaseStatus:
        started = time.monotonic()
        try:
            status = client.ask("pin", [remote_req], self._timeout_s, {remote_req: reader})
            return status[remote_req]
        except LeaseAskFailed as exc:
            logger.warning(
                "vllm-hybrid-nixl: pin of prefill request %s failed after %.0f ms: %s",
                remote_req,
                (time.monotonic() - started) * 1e3,
                exc,
            )
            return LeaseStatus(LeaseState.UNKNOWN, str(exc))


class LeaseRenewer:
    """A daemon thread that renews the leases of decode requests still waiting for their
    turn, so a busy decode engine never lets a prefill engine release blocks it will read."""

    def __init__(self, peers: LeasePeers, timeout_s: float) -> None:
        self._peers, self._timeout_s = peers, timeout_s
        self._waiting: dict[str, tuple[LeaseAddress, str, float]] = {}
        self._in_flight: dict[LeaseAddress, Future[None]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, decode_req: str, address: LeaseAddress, remote_req: str, lease_s: float) -> None:
        with self._lock:
            self._waiting[decode_req] = (address, remote_req, lease_s)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hybrid-nixl-lease-renewer", daemon=True
                )
                self._thread.start()

    def drop(self, decode_req: str) -> None:
        with self._lock:
            self._waiting.pop(decode_req, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                snapshot = list(self._waiting.values())
            by_address: dict[LeaseAddress, list[str]] = defaultdict(list)
            every = RENEW_EVERY_S
            for address, remote_req, lease_s in snapshot:
                by_address[address].append(remote_req)
                every = min(every, max(lease_s / 3, 0.1))
            for address, remote_reqs in by_address.items():
                previous = self._in_flight.get(address)
                if previous is not None and not previous.done():
                    continue  # that engine is slow to answer: no pile-up behind it
                client, executor = self._peers.get(address)
                self._in_flight[address] = executor.submit(self._renew, client, remote_reqs)
            for address in [a for a in self._in_flight if a not in by_address]:
                del self._in_flight[address]
            time.sleep(every)

    def _renew(self, client: LeaseClient, remote_reqs: list[str]) -> None:
        for start in range(0, len(remote_reqs), MAX_IDS):
            try:
                client.ask("renew", remote_reqs[start : start + MAX_IDS], self._timeout_s)
            except LeaseAskFailed as exc:
                logger.warning("vllm-hybrid-nixl: lease renewal failed: %s", exc)
                return
