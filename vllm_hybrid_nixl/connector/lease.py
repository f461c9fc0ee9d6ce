"""What the lease guard adds to vLLM's NIXL connector, on both engines.

Prefill engine (scheduler): every request that finishes with its blocks kept for a decode
engine is held in a :class:`LeaseTable` and its ``kv_transfer_params`` name the lease
service; vLLM frees those blocks only when the table says so (after the decode's read, or
when the lease or a pin runs out). vLLM's own lease is pushed out of the way.

Decode engine (scheduler, 0.32+): before the worker reads a request's blocks, it is pinned
on its prefill engine. A refused pin (released, unknown, restarted, unreachable) is logged
with the cause and handed to the worker, which reports the read as a failed KV load: vLLM
then fails the request or recomputes it (``kv_load_failure_policy``), never samples from it.

Releases before 0.32 report failed loads only as invalid block ids, and their scheduler dies
on those for models with several KV-cache groups (``(req_block_ids,) = get_block_ids(...)``
in ``_update_requests_with_invalid_blocks``, measured on 0.27.1). There the pin happens when
vLLM first asks how many tokens the request will load (``get_num_new_matched_tokens``); a
refused one loads none and the decode engine computes the prompt itself: the answer is right,
and the log names the cause, whatever ``kv_load_failure_policy`` says.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseStatus, LeaseTable
from vllm_hybrid_nixl.protocol.lease_wire import (
    PARAMS_KEY,
    LeaseAddress,
    LeaseServer,
    LeaseUnreachable,
    ask,
)

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: ``kv_connector_extra_config`` keys.
LEASE_KEY = "kv_lease_duration"  # vLLM's own key; its default is 30 s
PIN_KEY = "kv_pin_duration"
PORT_KEY = "lease_port"
TIMEOUT_KEY = "lease_check_timeout"
GUARD_KEY = "lease_guard"  # false turns the guard off on this engine (benchmarks, stock peers)
DEFAULT_LEASE_S = 30.0
#: After a prefill engine's lease service failed to answer, pins to it are refused at once
#: for this long instead of stalling the decode engine core for the timeout every step.
UNREACHABLE_HOLD_S = 10.0
#: A pin slower than this is logged: the decode engine core waits for it every step it pins.
SLOW_PIN_S = 0.1
#: Refusals a decode worker hands from its scheduler, on vLLM's connector metadata.
REFUSALS_ATTRIBUTE = "hybrid_lease_refusals"


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


class LeaseHolderMixin:
    """Connector (scheduler role): hold, serve and settle leases on prefill engines; pin
    them before reading on decode engines."""

    connector_scheduler: Any

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self._lease_server: LeaseServer | None = None
        self._lease_guard = False
        self._lease_pending: dict[str, tuple[LeaseAddress, str, str]] = {}
        self._refused_early: set[str] = set()
        self._warned_unguarded = False
        self._unreachable: dict[LeaseAddress, tuple[float, str]] = {}
        if getattr(self, "connector_scheduler", None) is None:
            return  # worker role
        config = vllm_config.kv_transfer_config
        self._lease_guard = bool(config.get_from_extra_config(GUARD_KEY, True))
        if not self._lease_guard:
            logger.warning("vllm-hybrid-nixl: the KV lease guard is off (lease_guard: false)")
            return
        self._lease_policy = compat.kv_load_failure_policy(config)
        self._lease_timeout_s = float(config.get_from_extra_config(TIMEOUT_KEY, 2.0))
        if config.is_kv_producer:
            self._start_lease_service(config)

    def _start_lease_service(self, config: Any) -> None:
        lease_s = float(config.get_from_extra_config(LEASE_KEY, DEFAULT_LEASE_S))
        pin_s = float(config.get_from_extra_config(PIN_KEY, max(lease_s, DEFAULT_LEASE_S)))
        # vLLM's worker frees on its own lease; keep that one well past ours and pins.
        stock_lease_s = lease_s + pin_s + 60
        table = LeaseTable(lease_s, pin_s, forget_after_s=stock_lease_s + 60)
        compat.extend_stock_lease(self.connector_scheduler, stock_lease_s)
        host = getattr(self.connector_scheduler, "side_channel_host", None) or "127.0.0.1"
        port = int(config.get_from_extra_config(PORT_KEY, 0))
        self._lease_server = LeaseServer(table, host, port)
        logger.info(
            "vllm-hybrid-nixl: KV lease service on %s (lease %g s, pin %g s, epoch %s)",
            self._lease_server.address.endpoint,
            lease_s,
            pin_s,
            table.epoch,
        )

    # ---- prefill engine ------------------------------------------------------------------

    def _with_lease(self, request: Any, delay: bool, params: dict | None) -> dict | None:
        if self._lease_server is None or not delay or not params:
            return params
        if not params.get("do_remote_prefill"):
            return params  # not a prefill answer
        self._lease_server.table.hold(request.request_id)
        params[PARAMS_KEY] = self._lease_server.address.to_params()
        return params

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        self._refused_early.discard(request.request_id)
        delay, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        return delay, self._with_lease(request, delay, params)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        self._refused_early.discard(request.request_id)
        delay, params = super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]
        return delay, self._with_lease(request, delay, params)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._lease_server is not None:
            finished = set(connector_output.finished_sending or ())
            connector_output.finished_sending = self._lease_server.table.settle(finished)
        super().update_connector_output(connector_output)  # type: ignore[misc]

    # ---- decode engine -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if self._lease_guard and not compat.transfer_results_api():
            if self._refused_before_loading(request):
                return 0, False  # nothing to load: the decode engine computes the prompt
        return super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens
        )

    def _lease_of(self, request: Any) -> tuple[LeaseAddress, str, str] | None:
        """(lease service, prefill request id, prefill engine id) of a request whose KV is to
        come from a prefill engine; None when it has no lease (warned once: a stock peer)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        address = LeaseAddress.from_params(params.get(PARAMS_KEY))
        if address is None:
            if not self._warned_unguarded:
                self._warned_unguarded = True
                logger.warning(
                    "vllm-hybrid-nixl: prefill engine %s sent no KV lease (a stock "
                    "NixlConnector?); blocks it releases early cannot be detected",
                    params.get("remote_engine_id"),
                )
            return None
        return address, str(params.get("remote_request_id")), str(params.get("remote_engine_id"))

    def _refusal(
        self, req_id: str, lease: tuple[LeaseAddress, str, str], status: LeaseStatus, policy: str
    ) -> str:
        address, remote_req, engine = lease
        message = refusal_message(req_id, remote_req, engine, address, status, policy)
        logger.error("%s", message)
        return message

    def _refused_before_loading(self, request: Any) -> bool:
        """Pin now (releases that cannot fail a hybrid load); True when refused."""
        if request.request_id in self._refused_early:
            return True
        lease = self._lease_of(request)
        if lease is None:
            return False
        status = self._pin_at(lease[0], [lease[1]])[lease[1]]
        if status.readable:
            return False
        self._refused_early.add(request.request_id)
        self._refusal(request.request_id, lease, status, "recompute")
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        # Pinned just before the read on releases that report failed loads per request;
        # earlier releases were pinned in get_num_new_matched_tokens, in this same step.
        if self._lease_guard and num_external_tokens > 0 and compat.transfer_results_api():
            lease = self._lease_of(request)
            if lease is not None:
                self._lease_pending[request.request_id] = lease
        return super().update_state_after_alloc(  # type: ignore[misc]
            request, blocks, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        refusals = self._pin_pending() if self._lease_pending else {}
        metadata = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        if refusals:
            setattr(metadata, REFUSALS_ATTRIBUTE, refusals)
        return metadata

    def _pin_pending(self) -> dict[str, str]:
        """Pin every request about to be read; the refused ones, with their messages."""
        by_address: dict[LeaseAddress, dict[str, tuple[str, str]]] = defaultdict(dict)
        for req_id, (address, remote_req, engine) in self._lease_pending.items():
            by_address[address][remote_req] = (req_id, engine)
        self._lease_pending = {}
        refusals = {}
        for address, requests in by_address.items():
            answers = self._pin_at(address, list(requests))
            for remote_req, status in answers.items():
                if status.readable:
                    continue
                req_id, engine = requests[remote_req]
                lease = (address, remote_req, engine)
                refusals[req_id] = self._refusal(req_id, lease, status, self._lease_policy)
        return refusals

    def _pin_at(self, address: LeaseAddress, remote_reqs: list[str]) -> dict[str, LeaseStatus]:
        now = time.monotonic()
        failed = self._unreachable.get(address)
        if failed is None or now - failed[0] > UNREACHABLE_HOLD_S:
            try:
                answers = ask(address, "pin", remote_reqs, self._lease_timeout_s)
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
            except LeaseUnreachable as exc:
                failed = (now, str(exc))
                self._unreachable[address] = failed
        return {r: LeaseStatus(LeaseState.UNKNOWN, failed[1]) for r in remote_reqs}


class LeaseReaderMixin:
    """Worker (decode engine, vLLM 0.32+): a read whose pin was refused completes as a failed
    load (``failed_recving``, kept in ``finished_recving`` as vLLM's own worker does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lease_refused: set[str] = set()
        super().__init__(*args, **kwargs)

    def start_load_kv(self, metadata: Any) -> Any:
        self._lease_refused.update(getattr(metadata, REFUSALS_ATTRIBUTE, None) or ())
        return super().start_load_kv(metadata)  # type: ignore[misc]

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()  # type: ignore[misc]
        done = self._lease_refused & results.finished_recving
        if done:
            self._lease_refused -= done
            results.failed_recving.update(done)
        return results
