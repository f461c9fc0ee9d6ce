"""The decode worker's check after a read: the prefill engine still held the blocks when the
read completed.

The decode scheduler knows, from its acknowledged pins and renewals, a time until which the
prefill engine keeps a request's blocks (its lease service extended the deadline *after* the
question was sent, so question time + extension is a lower bound), and whether a renewal
during the read was answered "released". Every step it hands the worker the holds of all
requests whose read is under way (:func:`holds_payload`); the worker replaces its view with
each payload. On the scheduler's host (same boot) the deadlines are ``time.monotonic`` values
compared as they are; on another host they are converted through the payload's build time,
less :data:`CROSS_HOST_MARGIN_S` for the hand-over. A read the worker sees complete past its
deadline, or after a release, may have copied blocks the prefill engine had given to another
request: it is reported as a failed load, never used.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: Metadata attribute carrying :func:`holds_payload`.
HOLDS_ATTRIBUTE = "hybrid_lease_holds"
#: Subtracted from deadlines converted across hosts (metadata can be built a step or two
#: before the worker sees it under asynchronous scheduling).
CROSS_HOST_MARGIN_S = 5.0
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id() -> str:
    """This kernel boot's id: equal ids mean ``time.monotonic`` values are comparable."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def holds_payload(
    until: Mapping[str, float], lost: Iterable[str], now: float | None = None
) -> dict[str, object]:
    """What the scheduler sends: absolute deadlines on its clock, the reads whose lease a
    renewal found released, and when and where it was built."""
    return {
        "boot": boot_id(),
        "at": time.monotonic() if now is None else now,
        "until": dict(until),
        "lost": sorted(lost),
    }


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class ReadHolds:
    """Per reading request, the worker-clock time until which its blocks were surely held
    (``-inf`` once a renewal found them released)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, boot: str | None = None):
        self._clock = clock
        self._boot = boot_id() if boot is None else boot
        self._deadlines: dict[str, float] = {}

    def update(self, payload: object) -> None:
        """Replace the view with the scheduler's latest payload (None or anything that is
        not a payload: no read under way, nothing to check)."""
        self._deadlines = {}
        if not isinstance(payload, dict):
            return
        until, at = payload.get("until"), payload.get("at")
        if isinstance(until, dict):
            same_host = bool(self._boot) and payload.get("boot") == self._boot
            shift = 0.0
            if not same_host:
                if not _finite(at):
                    until = {}
                else:
                    shift = self._clock() - float(at) - CROSS_HOST_MARGIN_S
            for req_id, deadline in until.items():
                if _finite(deadline):
                    self._deadlines[str(req_id)] = float(deadline) + shift
        lost = payload.get("lost")
        if isinstance(lost, list):
            for req_id in lost:
                self._deadlines[str(req_id)] = -math.inf

    def late_reads(self, finished: Iterable[str], failed: Iterable[str]) -> dict[str, float]:
        """Reads in ``finished`` (and not ``failed``) that completed past their deadline,
        with how late (``inf``: after a release was reported); each is checked once."""
        now = self._clock()
        failed = set(failed)
        late = {}
        for req_id in finished:
            deadline = self._deadlines.pop(req_id, None)
            if deadline is not None and req_id not in failed and now > deadline:
                late[req_id] = now - deadline
        return late


def late_read_message(req_id: str, late_s: float) -> str:
    if math.isinf(late_s):
        when = "after its prefill engine answered a lease renewal that the blocks were released"
    else:
        when = (
            f"{late_s:.2f} s after the last time its prefill engine was known to hold the "
            "blocks (no pin or lease renewal was acknowledged in time)"
        )
    return (
        f"vllm-hybrid-nixl: request {req_id}: its KV read completed {when}, so the bytes may "
        "belong to another request. The load is reported failed instead of decoding from "
        "them. What to change: keep the prefill engine's lease service reachable from the "
        "decode engine, or raise kv_pin_duration / kv_lease_duration in the prefill engine's "
        "kv_connector_extra_config."
    )
