"""What the lease guard adds to vLLM's NIXL connector, on both engines.

Prefill engine (scheduler): every request that finishes with its blocks kept for a decode
engine is held in a :class:`LeaseTable` and its ``kv_transfer_params`` name the lease
service; vLLM frees those blocks only when the table says so (after the decode's read, or
when the lease or a pin runs out). vLLM's own lease is pushed out of the way.

Decode engine (scheduler, 0.32+): before blocks are allocated for a request's read, its
lease is pinned on its prefill engine. The question is asked as the request arrives, on a
background thread (:mod:`.lease_background`), or with ``direct_pins`` from the scheduler's
own thread, which reads the answer without waiting (:mod:`.direct_pin`). vLLM is told the
request is not ready yet (``None`` matched tokens) until the answer is in, so a slow or
silent lease service delays only the requests that need it. A refused pin
(released, taken, unknown, restarted, unreachable) is logged with the cause; under
``kv_load_failure_policy: recompute`` the request computes its prompt itself, under ``fail``
the refusal is handed to the worker, which reports the read as a failed KV load. Never is a
request sampled from blocks whose pin was refused.

Before any of that, on every release, a decode request whose ``kv_transfer_params`` cannot be
its own (the prefill's prompt digest differs from its prompt, another decode request on this
engine already reads that prefill request, or the lease value is unusable) never reads them:
it computes its prompt itself, so a batch answered with one prompt's parameters, a duplicated
leg or a careless client gets right tokens and nothing foreign is cached. While a decode
request waits for its turn, a background thread renews its lease; no message of the lease
protocol, well-formed or not, can raise out of the scheduler.

Prefill engines free each kept request exactly once, and only requests vLLM kept for a
decode: leases that expire are reported through the worker (the path vLLM frees by), so a
prefill engine that runs empty steps frees them within a step of expiry.

Releases before 0.32 report failed loads only as invalid block ids, and their scheduler dies
on those for models with several KV-cache groups (``(req_block_ids,) = get_block_ids(...)``
in ``_update_requests_with_invalid_blocks``, measured on 0.27.1). There the pin happens when
vLLM first asks how many tokens the request will load (``get_num_new_matched_tokens``); a
refused one loads none and the decode engine computes the prompt itself: the answer is right,
and the log names the cause, whatever ``kv_load_failure_policy`` says.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from vllm_hybrid_nixl.common.netutil import LEASE_PORT_OFFSET
from vllm_hybrid_nixl.connector import compat, kv_timeline
from vllm_hybrid_nixl.connector.digest_guard import (
    EXPECT_ATTRIBUTE,
    SOURCES_ATTRIBUTE,
    digest_enabled,
    digest_port_base,
)
from vllm_hybrid_nixl.connector.direct_pin import DirectPins
from vllm_hybrid_nixl.connector.extra_settings import strict_bool
from vllm_hybrid_nixl.connector.lease_background import LeasePeers, LeaseRenewer, Pinner
from vllm_hybrid_nixl.connector.read_holds import (
    HOLDS_ATTRIBUTE,
    ReadHolds,
    holds_payload,
    late_read_message,
)
from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import (
    PARAMS_KEY,
    LeaseAddress,
    LeaseParamsError,
    LeaseServer,
    ask,
)

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: ``kv_connector_extra_config`` keys.
LEASE_KEY = "kv_lease_duration"  # vLLM's own key; its default is 30 s
PIN_KEY = "kv_pin_duration"
PORT_KEY = "lease_port"
TIMEOUT_KEY = "lease_check_timeout"
#: Off by default: on, 78% of requests found their pin answered at their first schedule()
#: against 35% (32 concurrent, tiny hybrid, 2 cores), yet output tokens/s were 0.92x over ten
#: alternating on/off rounds (bench.connector_ab), for a reason not found.
DIRECT_PINS_KEY = "direct_pins"
DIRECT_PINS_MEANING = "true sends pins from the scheduler's thread (connector/direct_pin.py)"
GUARD_KEY = "lease_guard"  # false turns the guard off on this engine (benchmarks, stock peers)
DEFAULT_LEASE_S = 30.0
#: After a prefill engine's lease service failed to answer, pins to it are refused at once
#: for this long instead of stalling the decode engine core for the timeout every step.
UNREACHABLE_HOLD_S = 10.0
#: A pin slower than this is logged: the decode engine core waits for it every step it pins.
SLOW_PIN_S = 0.1
#: A pin asked as its request arrived is asked again at the request's first schedule()
#: when it is older than this (the request queued): the read then follows a fresh answer.
REPIN_AFTER_S = 1.0
#: Refusals a decode worker hands from its scheduler, on vLLM's connector metadata.
REFUSALS_ATTRIBUTE = "hybrid_lease_refusals"
#: Expired leases a prefill worker reports as finished sends, on vLLM's connector metadata.
EXPIRED_ATTRIBUTE = "hybrid_lease_expired"


def prompt_digest(token_ids: Sequence[int] | None, request: Any = None) -> str:
    """SHA-256 of a prompt's token ids (as 64-bit integers) and of what else makes its KV
    (the cache salt, the LoRA adapter, the multimodal inputs' identifiers, from ``request``
    where vLLM's request has them): binds a prefill to its prompt."""
    digest = hashlib.sha256(array("q", token_ids or ()).tobytes())
    if request is not None:
        lora = getattr(request, "lora_request", None)
        features = getattr(request, "mm_features", None) or ()
        extras = [
            str(getattr(request, "cache_salt", None) or ""),
            str(getattr(lora, "lora_name", "") if lora is not None else ""),
            *(str(getattr(f, "identifier", "")) for f in features),
        ]
        if any(extras):
            digest.update("\x00".join(extras).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class RemoteKv:
    """Where a decode request's prefilled KV comes from, as its ``kv_transfer_params`` say."""

    remote_req: str
    engine: str
    address: LeaseAddress | None
    problem: str = ""  # why the lease value is unusable
    prompt_tokens: int | None = None  # what the prefill engine prefilled (None: not said)
    prompt_sha256: str = ""
    lease_s: float = DEFAULT_LEASE_S
    pin_s: float | None = None  # how long a pin holds the blocks (None: an older peer)
    digest_port: int | None = None  # the prefill's first KV digest port (None: sends none)

    def describe(self) -> str:
        where = f" ({self.address.host})" if self.address else ""
        return f"prefill request {self.remote_req} on engine {self.engine}{where}"


def _pin_answer(future: Future[LeaseStatus]) -> LeaseStatus:
    """A finished pin's status; a failed question is an ``UNKNOWN`` status naming why."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - the Pinner answers statuses; never trust it
        return LeaseStatus(LeaseState.UNKNOWN, f"the pin failed: {exc!r:.300}")


def refusal_message(
    decode_req: str,
    remote_req: str,
    engine: str,
    address: LeaseAddress,
    status: LeaseStatus,
    policy: str,
) -> str:
    """Why the decode engine will not use request ``decode_req``'s prefilled blocks."""
    where = f"prefill request {remote_req} on engine {engine} ({address.host})"
    if status.state is LeaseState.RELEASED:
        cause = (
            f"the prefill engine released its KV blocks {status.released_ago_s:.1f} s before "
            f"this decode engine could read them: {status.reason} (lease "
            f"{status.lease_s:g} s)"
        )
        change = (
            "raise kv_lease_duration in the prefill engine's kv_connector_extra_config, or "
            "send decode legs sooner (a proxy or client that waits longer than the lease)"
        )
    elif status.state is LeaseState.TAKEN:
        cause = status.reason
        change = (
            "give every decode request its own prefill leg (one per prompt of a batch and "
            "per choice of n > 1; the vllm-hybrid-nixl router does this)"
        )
    else:
        cause = status.reason or (
            "the prefill engine does not know this request (restarted, or the request is "
            "older than its lease records)"
        )
        change = "re-run the request through a fresh prefill leg"
    outcome = "is recomputed on this engine" if policy == "recompute" else "fails"
    return (
        f"vllm-hybrid-nixl: request {decode_req} ({where}): {cause}. The request {outcome} "
        f"instead of decoding from blocks that may hold another prompt's KV "
        f"(kv_load_failure_policy={policy}). What to change: {change}."
    )


def local_refusal_message(decode_req: str, remote: RemoteKv, cause: str, change: str) -> str:
    """Why a decode request computes its prompt itself instead of reading ``remote``."""
    return (
        f"vllm-hybrid-nixl: request {decode_req} ({remote.describe()}): {cause}. The request "
        f"computes its prompt on this engine instead of reading those KV blocks. What to "
        f"change: {change}."
    )


class LeasePortInUse(RuntimeError):
    """The lease service's configured port cannot be bound."""


class LeaseHolderMixin:
    """Connector (scheduler role): hold, serve and settle leases on prefill engines; check,
    renew and pin them before reading on decode engines."""

    connector_scheduler: Any
    #: Whether prefill engines of this connector serve KV digests (push workers check none).
    _lease_digests = True

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self._vllm_config = vllm_config
        self._lease_server: LeaseServer | None = None
        self._lease_guard = False
        self._lease_pending: dict[str, str] = {}  # decode: reads to fail, with messages
        self._refused_early: set[str] = set()
        self._warned_unguarded = False
        self._unreachable: dict[LeaseAddress, tuple[float, str]] = {}
        self._delayed: set[str] = set()  # prefill: requests vLLM keeps for a decode engine
        self._claims: dict[tuple[str, str], str] = {}  # decode: remote request -> reader
        self._accepted: dict[str, RemoteKv] = {}  # decode: requests that passed those checks
        self._renewer: LeaseRenewer | None = None
        self._pinner: Pinner | None = None
        self._direct_pins: DirectPins | None = None  # decode: pins asked on this thread
        self._pins: dict[str, Future[LeaseStatus]] = {}  # decode: pins under way
        self._pinned: set[str] = set()  # decode: pins that succeeded
        self._refused_reads: dict[str, str] = {}  # decode: refused pins -> their messages
        self._pin_sent: dict[str, float] = {}  # decode: when each pin under way was asked
        self._pin_holds: dict[str, float] = {}  # decode: held at least until (pin acks)
        self._early_pins: set[str] = set()  # decode: pins asked as the request arrived
        self._reading: set[str] = set()  # decode: pinned requests whose read has started
        self._timeline_live: set[str] = set()  # decode: unfinished requests (timeline)
        self._timeline_received: set[str] = set()  # decode: read, not yet computed (timeline)
        self._digest_port: int | None = None  # prefill: where its workers serve KV digests
        self._digest_sources: dict[str, Any] = {}  # prefill: blocks to digest next step
        if getattr(self, "connector_scheduler", None) is None:
            return  # worker role
        config = vllm_config.kv_transfer_config
        self._lease_guard = bool(config.get_from_extra_config(GUARD_KEY, True))
        if not self._lease_guard:
            logger.warning(
                "vllm-hybrid-nixl: the KV lease guard is off (lease_guard: false); reads "
                "through this engine are not verified by the KV digest either (its port "
                "travels in the lease value)"
            )
            return
        self._lease_policy = compat.kv_load_failure_policy(config)
        self._lease_timeout_s = float(config.get_from_extra_config(TIMEOUT_KEY, 2.0))
        peers = LeasePeers()
        self._renewer = LeaseRenewer(peers, self._lease_timeout_s)
        self._pinner = Pinner(peers, self._lease_timeout_s)
        if strict_bool(config, DIRECT_PINS_KEY, False, DIRECT_PINS_MEANING):
            self._direct_pins = DirectPins(self._lease_timeout_s, self._pinner.submit)
        if config.is_kv_producer:
            self._start_lease_service(config)
            if self._lease_digests and digest_enabled(config) and compat.digest_hooks_available():
                self._digest_port = digest_port_base(vllm_config)

    def _start_lease_service(self, config: Any) -> None:
        lease_s = float(config.get_from_extra_config(LEASE_KEY, DEFAULT_LEASE_S))
        pin_s = float(config.get_from_extra_config(PIN_KEY, max(lease_s, DEFAULT_LEASE_S)))
        # vLLM's worker frees on its own lease; keep that one well past ours and pins.
        stock_lease_s = lease_s + pin_s + 60
        table = LeaseTable(lease_s, pin_s, forget_after_s=stock_lease_s + 60)
        compat.extend_stock_lease(self.connector_scheduler, stock_lease_s)
        host = getattr(self.connector_scheduler, "side_channel_host", None) or "127.0.0.1"
        self._lease_server = self._bind_lease_service(table, host, config)
        logger.info(
            "vllm-hybrid-nixl: KV lease service on %s (lease %g s, pin %g s, epoch %s)",
            self._lease_server.address.endpoint,
            lease_s,
            pin_s,
            table.epoch,
        )

    def _bind_lease_service(self, table: LeaseTable, host: str, config: Any) -> LeaseServer:
        """The lease service on ``lease_port`` + the data-parallel rank when set (0: a free
        port), else on the side-channel port + ``LEASE_PORT_OFFSET`` (which already carries
        vLLM's data-parallel offset: 5600 -> 6600); a port in use is an
        error by name when it was set, a warning and a free port when it was derived."""
        configured = config.get_from_extra_config(PORT_KEY, None)
        if configured is not None:
            base = int(configured)
            port = base + compat.data_parallel_index(self._vllm_config) if base else 0
        else:
            side = getattr(self.connector_scheduler, "side_channel_port", None)
            port = side + LEASE_PORT_OFFSET if isinstance(side, int) and side > 0 else 0
            if port > 65535:
                port = 0
        try:
            return LeaseServer(table, host, port)
        except zmq.ZMQError as exc:
            if configured is not None or port == 0:
                raise LeasePortInUse(
                    f"vllm-hybrid-nixl: the KV lease service could not listen on {host}:{port} "
                    f"({exc}). What to change: give each engine on this host its own "
                    f"lease_port in kv_connector_extra_config (the data-parallel rank is "
                    f"added to it), or stop what holds the port."
                ) from exc
            logger.warning(
                "vllm-hybrid-nixl: the KV lease service's default port %s:%d (side-channel "
                "port + %d) is taken (%s); listening on a free port instead. Decode engines on "
                "other hosts reach it only if that port is open: set lease_port.",
                host,
                port,
                LEASE_PORT_OFFSET,
                exc,
            )
            return LeaseServer(table, host, 0)

    # ---- prefill engine ------------------------------------------------------------------

    def _with_lease(self, request: Any, delay: bool, params: dict | None) -> dict | None:
        if delay and self._lease_server is not None:
            self._delayed.add(request.request_id)
        if self._lease_server is None or not delay or not params:
            return params
        if not params.get("do_remote_prefill"):
            return params  # not a prefill answer
        table = self._lease_server.table
        table.hold(request.request_id)
        prompt = list(request.prompt_token_ids or ())
        params[PARAMS_KEY] = {
            **self._lease_server.address.to_params(),
            "lease_s": table.lease_s,
            "pin_s": table.pin_s,
            "prompt_tokens": len(prompt),
            "prompt_sha256": prompt_digest(prompt, request),
        }
        if self._digest_port is not None and params.get("remote_block_ids"):
            params[PARAMS_KEY]["digest_port"] = self._digest_port
            self._digest_sources[request.request_id] = [
                list(group) for group in params["remote_block_ids"]
            ]
        return params

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        self._finished_on_decode(request)
        delay, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        return delay, self._with_lease(request, delay, params)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        self._finished_on_decode(request)
        delay, params = super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]
        return delay, self._with_lease(request, delay, params)

    def update_connector_output(self, connector_output: Any) -> None:
        if kv_timeline.enabled() and connector_output.finished_recving:
            seen = connector_output.finished_recving
            failed = getattr(connector_output, "failed_recving", None)  # 0.32+
            kv_timeline.record_all("recv_seen", seen, failed)
            self._timeline_received.update(r for r in seen if r in self._timeline_live)
        if self._renewer is not None:
            for req_id in connector_output.finished_recving or ():
                self._renewer.drop(req_id)  # read (or failed): the lease is no longer wanted
                self._reading.discard(req_id)
                self._pin_holds.pop(req_id, None)
        if self._lease_server is not None:
            finished = set(connector_output.finished_sending or ())
            released = self._lease_server.table.settle(finished)
            # Only what vLLM still keeps, each once: a late or repeated report of a request
            # vLLM already freed would kill its scheduler.
            free = (finished | released) & self._delayed
            self._delayed -= free
            connector_output.finished_sending = free
        super().update_connector_output(connector_output)  # type: ignore[misc]

    def _expired_to_report(self) -> set[str]:
        """Leases that ran out since the last step, for the worker to report as finished
        sends (vLLM frees blocks only for what a worker reports)."""
        if self._lease_server is None:
            return set()
        return self._lease_server.table.settle(set()) & self._delayed

    # ---- decode engine -------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if kv_timeline.enabled() and _loads_remote_kv(request):
            kv_timeline.record("arrive", request.request_id)
            self._timeline_live.add(request.request_id)
        parent = getattr(super(), "on_new_request", None)
        if parent is not None:
            parent(request)
        if not self._lease_guard or self._renewer is None:
            return
        remote = self._lease_of(request)
        if remote is not None and remote.address is not None and not remote.problem:
            self._renewer.add(request.request_id, remote.address, remote.remote_req, remote.lease_s)
            self._pin_on_arrival(request)

    def _pin_on_arrival(self, request: Any) -> None:
        """Ask for the pin as the request arrives, so its answer is usually in by the
        request's first schedule() (which otherwise asks, skips the request and comes back
        a step later). The renewer keeps a pinned lease alive while the request queues."""
        if not compat.transfer_results_api():
            return  # older releases pin inside the scheduler's step
        if getattr(request, "skip_reading_prefix_cache", False):
            return  # it will compute locally: nothing to pin
        if getattr(request, "abort_immediately", False):
            return  # vLLM's stand-in for a request its API server rejected: never read
        if self._refused_before_loading(request):
            return  # refused by name at its first schedule()
        if self._pin_in_background(request):
            self._early_pins.add(request.request_id)

    def _pin_granted(self, req_id: str) -> bool:
        """Whether the request's pin is answered and granted, its answer not yet read by
        its first schedule()."""
        if self._direct_pins is not None:
            self._direct_pins.collect()
        future = self._pins.get(req_id)
        return future is not None and future.done() and _pin_answer(future).readable

    def _finished_on_decode(self, request: Any) -> None:
        req_id = request.request_id
        params = request.kv_transfer_params
        if (
            self._lease_guard
            and compat.transfer_results_api()
            and isinstance(params, dict)
            and params.get("do_remote_prefill")
            and req_id not in self._pinned
            and not self._pin_granted(req_id)  # pinned on arrival, aborted while queued
            and self._lease_of(request) is not None
        ):
            # Finished (aborted) before its pin: vLLM would send the prefill a notice that
            # frees the blocks, possibly under the reader that pinned them. The lease ends
            # them instead. (A granted pin is this request's own: the notice ends it.)
            params["do_remote_prefill"] = False
        self._early_pins.discard(req_id)
        self._refused_early.discard(req_id)
        self._accepted.pop(req_id, None)
        pin = self._pins.pop(req_id, None)
        if self._direct_pins is not None:
            self._direct_pins.abandon(pin)  # not asked again for a request that is gone
        self._pinned.discard(req_id)
        self._refused_reads.pop(req_id, None)
        self._pin_sent.pop(req_id, None)
        self._pin_holds.pop(req_id, None)
        self._reading.discard(req_id)
        self._timeline_live.discard(req_id)
        self._timeline_received.discard(req_id)
        if self._renewer is not None:
            self._renewer.drop(req_id)
        for key in [k for k, owner in self._claims.items() if owner == req_id]:
            del self._claims[key]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if self._lease_guard:
            if self._refused_before_loading(request):
                return self._compute_locally(request)
            params = request.kv_transfer_params
            remote_prefill = isinstance(params, dict) and bool(params.get("do_remote_prefill"))
            if compat.transfer_results_api() and remote_prefill:
                skips_loading = getattr(request, "skip_reading_prefix_cache", False)
                if skips_loading and self._lease_of(request) is not None:
                    return self._compute_locally(request)  # vLLM would load nothing anyway
                pending = self._pin_in_background(request)
                if pending:
                    kv_timeline.record("schedule", request.request_id, ready=False)
                    return None, False  # asked again next step; other requests go on
                self._lost_lease(request.request_id)
                refusal = self._refused_reads.get(request.request_id)
                if refusal is not None and self._lease_policy == "recompute":
                    self._refused_reads.pop(request.request_id)
                    return self._compute_locally(request)
        matched = super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens
        )
        if kv_timeline.enabled() and _loads_remote_kv(request):
            kv_timeline.record("schedule", request.request_id, ready=True)
        return matched

    def _compute_locally(self, request: Any) -> tuple[int, bool]:
        """Nothing to load: the decode engine computes the prompt itself."""
        request.kv_transfer_params["do_remote_prefill"] = False  # as vLLM marks a handled one
        if self._renewer is not None:
            self._renewer.drop(request.request_id)
        return 0, False

    def _pin_in_background(self, request: Any) -> bool:
        """Pin the request's lease off the engine's step; True while the answer is pending.
        A refused pin leaves its message in ``_refused_reads``."""
        req_id = request.request_id
        if req_id in self._pinned or req_id in self._refused_reads or self._pinner is None:
            return False
        remote = self._accepted.get(req_id)
        if remote is None or remote.address is None:
            return False
        if self._direct_pins is not None:
            self._direct_pins.collect()
        future = self._pins.get(req_id)
        if future is None:
            self._ask_pin(req_id, remote)
            return True
        if not future.done():
            return True
        del self._pins[req_id]
        sent = self._pin_sent.pop(req_id, None)
        status = _pin_answer(future)
        asked_early = req_id in self._early_pins
        self._early_pins.discard(req_id)
        if status.readable and asked_early and sent is not None:
            if time.monotonic() - sent > REPIN_AFTER_S:
                # Queued a while since its pin on arrival: ask again (the same reader only
                # renews), so the read starts as close to a fresh answer as a late pin's.
                self._ask_pin(req_id, remote)
                return True
        if status.readable:
            self._pinned.add(req_id)
            if sent is not None and remote.pin_s is not None:
                self._pin_holds[req_id] = sent + remote.pin_s
        else:
            self._refused_reads[req_id] = self._refusal(req_id, remote, status, self._lease_policy)
        return False

    def _ask_pin(self, req_id: str, remote: RemoteKv) -> None:
        """Send the request's pin question to its prefill's lease service: from this
        (scheduler) thread when the endpoint's direct socket is free, else in the
        background."""
        assert self._pinner is not None and remote.address is not None  # checked by callers
        self._pin_sent[req_id] = time.monotonic()  # before the question: a lower bound
        reader = self._reader(req_id)
        future = None
        if self._direct_pins is not None:
            future = self._direct_pins.ask(remote.address, remote.remote_req, reader)
        direct = future is not None
        if future is None:
            future = self._pinner.submit(remote.address, remote.remote_req, reader)
        self._pins[req_id] = future
        kv_timeline.record("pin_asked", req_id, direct=direct)

    def _lease_of(self, request: Any) -> RemoteKv | None:
        """Where a request's KV is to come from; None when it comes from no prefill engine,
        or from one that sent no lease (warned once: a stock peer)."""
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        remote_req = str(params.get("remote_request_id"))
        engine = str(params.get("remote_engine_id"))
        lease = params.get(PARAMS_KEY)
        if lease is None:
            if not self._warned_unguarded:
                self._warned_unguarded = True
                logger.warning(
                    "vllm-hybrid-nixl: prefill engine %s sent no KV lease (a stock "
                    "NixlConnector?); blocks it releases early cannot be detected",
                    engine,
                )
            return None
        try:
            address = LeaseAddress.parse(lease)
        except LeaseParamsError as exc:
            return RemoteKv(remote_req, engine, None, f"its {PARAMS_KEY} value is unusable: {exc}")
        tokens, digest = lease.get("prompt_tokens"), lease.get("prompt_sha256")
        lease_s = lease.get("lease_s", DEFAULT_LEASE_S)
        if not _seconds(lease_s):
            lease_s = DEFAULT_LEASE_S
        pin_s = lease.get("pin_s")
        pin_s = float(pin_s) if _seconds(pin_s) else None
        digest_port = lease.get("digest_port")
        if digest_port is not None and not (
            isinstance(digest_port, int)
            and not isinstance(digest_port, bool)
            and 0 < digest_port < 65536
        ):
            problem = f"its {PARAMS_KEY} digest_port is not a port: {digest_port!r:.40}"
            return RemoteKv(remote_req, engine, address, problem)
        if tokens is None and digest is None:
            return RemoteKv(
                remote_req,
                engine,
                address,
                lease_s=float(lease_s),
                pin_s=pin_s,
                digest_port=digest_port,
            )
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not isinstance(digest, str):
            problem = f"its {PARAMS_KEY} value has no usable prompt_tokens / prompt_sha256"
            return RemoteKv(remote_req, engine, address, problem)
        return RemoteKv(
            remote_req, engine, address, "", tokens, digest, float(lease_s), pin_s, digest_port
        )

    def _tokens_to_load(self, request: Any) -> int:
        count = len(request.prompt_token_ids or ())
        scheduler = getattr(self, "connector_scheduler", None)
        trim = getattr(scheduler, "_get_remote_prefill_token_count", None)
        return int(trim(count)) if trim is not None else count

    def _mismatch(self, request: Any, remote: RemoteKv) -> str:
        """Why ``remote`` cannot hold this request's prompt (empty when it can)."""
        if remote.problem:
            return remote.problem
        if remote.prompt_tokens is None:
            return ""  # an older peer of ours: no prompt binding to check
        expected = self._tokens_to_load(request)
        prompt = list(request.prompt_token_ids or ())[: remote.prompt_tokens]
        digest = prompt_digest(prompt, request)
        if remote.prompt_tokens != expected or digest != remote.prompt_sha256:
            return (
                f"the prefill engine prefilled another prompt ({remote.prompt_tokens} tokens, "
                f"this request loads {expected}; the token digests differ): its "
                "kv_transfer_params belong to another request (a prompt list or n > 1 sent "
                "with one prefill's parameters?)"
            )
        return ""

    def _refused_before_loading(self, request: Any) -> bool:
        """Checks that need no read: the lease value, the prompt binding, one reader per
        prefill request on this engine, and (before 0.32) the pin. True when refused."""
        if request.request_id in self._refused_early:
            return True
        if request.request_id in self._accepted and compat.transfer_results_api():
            return False  # checked in an earlier step (it waits for its pin or its blocks)
        remote = self._lease_of(request)
        if remote is None:
            return False
        message = ""
        mismatch = self._mismatch(request, remote)
        owner = self._claims.get((remote.engine, remote.remote_req))
        if mismatch:
            message = local_refusal_message(
                request.request_id,
                remote,
                mismatch,
                "send every prompt (and every choice of n > 1) through its own prefill leg "
                "with the kv_transfer_params that leg returned",
            )
        elif owner is not None and owner != request.request_id:
            message = local_refusal_message(
                request.request_id,
                remote,
                f"decode request {owner} on this engine already reads those blocks",
                "give every decode request its own prefill leg (one per prompt of a batch and "
                "per choice of n > 1)",
            )
        elif not compat.transfer_results_api() and remote.address is not None:
            status = self._pin_at(remote.address, {remote.remote_req: request.request_id})
            status_of = status[remote.remote_req]
            if not status_of.readable:
                message = self._refusal(request.request_id, remote, status_of, "recompute")
        if message:
            if mismatch or (owner is not None and owner != request.request_id):
                logger.error("%s", message)  # pin refusals were logged by _refusal
            self._refused_early.add(request.request_id)
            return True
        self._claims[(remote.engine, remote.remote_req)] = request.request_id
        self._accepted[request.request_id] = remote
        return False

    def _refusal(self, req_id: str, remote: RemoteKv, status: LeaseStatus, policy: str) -> str:
        assert remote.address is not None  # refusals from a lease service have an address
        message = refusal_message(
            req_id, remote.remote_req, remote.engine, remote.address, status, policy
        )
        logger.error("%s", message)
        return message

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        req_id = request.request_id
        if num_external_tokens:
            kv_timeline.record("alloc", req_id, tokens=num_external_tokens)
        if self._renewer is not None and num_external_tokens == 0:
            self._renewer.drop(req_id)  # nothing to read: nothing to keep
        if self._lease_guard and compat.transfer_results_api():
            self._lost_lease(req_id)
            refusal = self._refused_reads.pop(req_id, None)
            if refusal is not None and num_external_tokens > 0:
                # A refused pin fails its read without reading: no NIXL read and no
                # completion notice, which would free blocks another reader holds.
                self._lease_pending[req_id] = refusal
            elif req_id not in self._pinned and self._lease_of(request) is not None:
                # Loads nothing without a pin (e.g. a full local prefix hit): no empty
                # read either, whose notice would free the prefill's blocks under their
                # pinned reader.
                request.kv_transfer_params["do_remote_prefill"] = False
        return super().update_state_after_alloc(  # type: ignore[misc]
            request, blocks, num_external_tokens
        )

    def _lost_lease(self, req_id: str) -> None:
        """A renewal found a pinned request's lease ended: its read is refused."""
        if self._renewer is None or req_id not in self._pinned:
            return
        status = self._renewer.take_lost(req_id)
        remote = self._accepted.get(req_id)
        if status is not None and remote is not None:
            self._pinned.discard(req_id)
            self._refused_reads[req_id] = self._refusal(req_id, remote, status, self._lease_policy)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        refusals, self._lease_pending = self._lease_pending, {}
        expired = self._expired_to_report()
        metadata = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        holds = self._read_holds(metadata, refusals)
        if holds:
            setattr(metadata, HOLDS_ATTRIBUTE, holds)
        if refusals:
            to_read = getattr(metadata, "reqs_to_recv", None)
            if isinstance(to_read, dict):
                for req_id in refusals:
                    to_read.pop(req_id, None)  # the worker reports it failed, unread
            # Push mode: nor is the prefill asked to write them (no registration is sent)
            compat.withdraw_push_registrations(self.connector_scheduler, metadata, refusals)
            setattr(metadata, REFUSALS_ATTRIBUTE, refusals)
        if expired:
            setattr(metadata, EXPIRED_ATTRIBUTE, expired)
        self._digest_metadata(metadata)
        if self._timeline_received:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            for req_id in [r for r in self._timeline_received if r in scheduled]:
                kv_timeline.record("scheduled", req_id, tokens=scheduled[req_id])
                self._timeline_received.discard(req_id)
        return metadata

    def _digest_metadata(self, metadata: Any) -> None:
        """Prefill: the blocks its workers digest this step. Decode: for each read starting
        this step, where the prefill serves its digests (none for a prefill that sends
        none: its workers then log the reads as unverified)."""
        if self._digest_sources:
            setattr(metadata, SOURCES_ATTRIBUTE, self._digest_sources)
            self._digest_sources = {}
        to_read = getattr(metadata, "reqs_to_recv", None)
        if not isinstance(to_read, dict) or not to_read:
            return
        expect: dict[str, dict[str, object]] = {}
        for req_id in to_read:
            remote = self._accepted.get(req_id)
            if remote is None:
                continue
            where: dict[str, object] = {"engine": remote.engine, "req": remote.remote_req}
            if remote.digest_port is not None and remote.address is not None:
                where.update(host=remote.address.host, port=remote.digest_port)
            expect[req_id] = where
        if expect:
            setattr(metadata, EXPECT_ATTRIBUTE, expect)

    def _read_holds(self, metadata: Any, refusals: dict[str, str]) -> dict[str, object]:
        """Each reading request's hold for the worker's check after the read
        (:mod:`.read_holds`): the latest acknowledged pin or renewal's bound, and the reads
        a renewal found released. Requests with no known bound (an older peer that sent no
        ``pin_s``, before its first renewal) are checked for releases only."""
        to_read = getattr(metadata, "reqs_to_recv", None)
        if isinstance(to_read, dict):
            self._reading.update(r for r in to_read if r in self._pinned and r not in refusals)
        if not self._reading:
            return {}
        until, lost = {}, []
        renewer = self._renewer
        for req_id in self._reading:
            renewed = renewer.held_until(req_id) if renewer is not None else None
            known = [t for t in (self._pin_holds.get(req_id), renewed) if t is not None]
            if known:
                until[req_id] = max(known)
            if renewer is not None and renewer.lost(req_id):
                lost.append(req_id)
        return holds_payload(until, lost)

    def _reader(self, decode_req: str) -> str:
        return f"{getattr(self, 'engine_id', '')}/{decode_req}"

    def _pin_at(self, address: LeaseAddress, readers: dict[str, str]) -> dict[str, LeaseStatus]:
        """Pin ``readers`` (prefill request -> decode request) at ``address``; every failure
        to get a usable answer is a refusal naming why."""
        remote_reqs = list(readers)
        now = time.monotonic()
        failed = self._unreachable.get(address)
        if failed is None or now - failed[0] > UNREACHABLE_HOLD_S:
            try:
                named = {r: self._reader(d) for r, d in readers.items()}
                answers = ask(address, "pin", remote_reqs, self._lease_timeout_s, named)
                self._unreachable.pop(address, None)
                waited = time.monotonic() - now
                if waited > SLOW_PIN_S:
                    logger.warning(
                        "vllm-hybrid-nixl: pinning %d lease(s) at %s took %.0f ms (the decode "
                        "engine core waits for it)",
                        len(remote_reqs),
                        address.endpoint,
                        waited * 1e3,
                    )
                return answers
            except Exception as exc:  # noqa: BLE001 - every failure is a refusal, by name
                failed = (now, str(exc) or repr(exc))
                self._unreachable[address] = failed
        return {r: LeaseStatus(LeaseState.UNKNOWN, failed[1]) for r in remote_reqs}


class LeaseReaderMixin:
    """Worker. Decode engine (vLLM 0.32+): a read whose pin was refused is never started (the
    scheduler takes it off the metadata's reads) and is reported as a failed load
    (``failed_recving``, also in ``finished_recving`` as vLLM's own worker reports them).
    Prefill engine: leases the scheduler saw expire are reported as finished sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lease_refused: set[str] = set()
        self._lease_expired: set[str] = set()
        self._read_holds = ReadHolds()
        super().__init__(*args, **kwargs)

    def start_load_kv(self, metadata: Any) -> Any:
        self._lease_refused.update(getattr(metadata, REFUSALS_ATTRIBUTE, None) or ())
        self._lease_expired.update(getattr(metadata, EXPIRED_ATTRIBUTE, None) or ())
        self._read_holds.update(getattr(metadata, HOLDS_ATTRIBUTE, None))
        return super().start_load_kv(metadata)  # type: ignore[misc]

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()  # type: ignore[misc]
        late = self._read_holds.late_reads(results.finished_recving, results.failed_recving)
        for req_id, late_s in late.items():
            logger.error("%s", late_read_message(req_id, late_s))
            results.failed_recving.add(req_id)
        if self._lease_refused:  # never read (the scheduler took them off the reads)
            results.finished_recving.update(self._lease_refused)
            results.failed_recving.update(self._lease_refused)
            self._lease_refused = set()
        if self._lease_expired:
            results.finished_sending.update(self._lease_expired)
            self._lease_expired = set()
        return results

    def get_finished(self) -> Any:
        sending, recving = super().get_finished()  # type: ignore[misc]
        if self._lease_expired and not compat.transfer_results_api():
            sending = set(sending) | self._lease_expired
            self._lease_expired = set()
        return sending, recving


def _loads_remote_kv(request: Any) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def _seconds(value: object) -> bool:
    """A usable duration from a peer's lease value: a finite number, not negative."""
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf")
    )
