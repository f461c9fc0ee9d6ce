"""The decode worker's check after a read: the prefill engine still held the blocks when the
read completed.

The decode scheduler knows, from its acknowledged pins and renewals, a time until which the
prefill engine keeps a request's blocks whatever happens (its lease service extended the
deadline *after* the question was sent, so question time + extension is a lower bound). It
hands the worker each reading request's remaining seconds every step; the worker turns them
into deadlines on its own clock, less :data:`CLOCK_MARGIN_S` for the time the metadata took to
arrive. A read the worker sees complete past its deadline may have copied blocks the prefill
engine had already given to another request: it is reported as a failed load, never used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

logger = logging.getLogger("vllm.hybrid_nixl.lease")

#: Metadata attribute: decode request -> seconds its blocks stay held from when it was built.
HOLDS_ATTRIBUTE = "hybrid_lease_holds"
#: Subtracted from every deadline: the scheduler-to-worker delay is not known exactly.
CLOCK_MARGIN_S = 0.25


class ReadHolds:
    """Per reading request, the worker-clock time until which its blocks were surely held."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deadlines: dict[str, float] = {}

    def update(self, remaining_s: Mapping[str, object] | None) -> None:
        """Take the scheduler's latest remaining seconds (values that are not finite numbers
        are ignored: the check then uses the last good deadline, or none)."""
        if not remaining_s:
            return
        now = self._clock()
        for req_id, seconds in remaining_s.items():
            if isinstance(seconds, int | float) and not isinstance(seconds, bool):
                if seconds == seconds and abs(seconds) != float("inf"):  # finite
                    self._deadlines[str(req_id)] = now + float(seconds) - CLOCK_MARGIN_S

    def late_reads(self, finished: Iterable[str], failed: Iterable[str]) -> dict[str, float]:
        """Reads in ``finished`` (and not ``failed``) completed past their deadline, with how
        late each was; every finished request's deadline is forgotten."""
        now = self._clock()
        failed = set(failed)
        late = {}
        for req_id in finished:
            deadline = self._deadlines.pop(req_id, None)
            if deadline is not None and req_id not in failed and now > deadline:
                late[req_id] = now - deadline
        return late

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._deadlines.pop(req_id, None)


def late_read_message(req_id: str, late_s: float) -> str:
    return (
        f"vllm-hybrid-nixl: request {req_id}: its KV read completed {late_s:.2f} s after the "
        "last time its prefill engine was known to hold the blocks (no pin or lease renewal "
        "was acknowledged in time), so the bytes may belong to another request. The load is "
        "reported failed instead of decoding from them. What to change: keep the prefill "
        "engine's lease service reachable from the decode engine, or raise kv_pin_duration / "
        "kv_lease_duration in the prefill engine's kv_connector_extra_config."
    )
