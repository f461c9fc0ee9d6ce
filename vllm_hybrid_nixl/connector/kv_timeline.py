"""Where a P/D request's wait for its KV goes on the decode engine, request by request.

With ``VLLM_HYBRID_NIXL_KV_TIMELINE`` set to a file path, the decode engine's scheduler and
workers append one JSON line per event of a request that loads its KV from a prefill engine:
``{"t": monotonic seconds, "pid": ..., "event": ..., "req": ...}`` plus the event's fields.
The clock is the machine's monotonic one, the same in every process on it. Unset (the
default), every call returns after one check. ``python -m bench.kv_timeline`` turns a file
into stage times.

Events, in a request's order:

- ``arrive``: the scheduler is handed the request (``on_new_request``);
- ``pin_asked``: its lease pin question is handed to the background pinner, or sent
  (``direct``: from the scheduler's thread, ``direct_pins``);
- ``schedule``: a ``schedule()`` asked how many tokens it loads; ``ready`` false while its
  pin is unanswered (the request waits a step), true once it is answered (granted or
  refused) or needs none;
- ``alloc``: blocks were allocated for its read;
- ``read_posted``: a worker started the step's reads (once per TP rank; a read to a prefill
  engine not yet handshaken is posted later, unrecorded);
- ``read_done``: NIXL reported the read complete (before the KV digest check);
- ``read_reported``: the worker reported it to vLLM (after the digest check);
- ``recv_seen``: the scheduler saw the report;
- ``scheduled``: the first step to compute the request after that.

``read_done``, ``read_reported`` and ``recv_seen`` carry ``failed: true`` for a read that
failed or was refused (never used). Pull mode only: push workers record no reads.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "VLLM_HYBRID_NIXL_KV_TIMELINE"

_path: str | None = os.environ.get(ENV) or None


def enabled() -> bool:
    return _path is not None


def record(event: str, req_id: str, **fields: Any) -> None:
    """Append one event line (one ``write`` on a file opened for appending: lines from
    several processes do not interleave)."""
    if _path is None:
        return
    line = {"t": time.monotonic(), "pid": os.getpid(), "event": event, "req": req_id, **fields}
    try:
        with open(_path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
    except OSError:
        pass  # a diagnostic never fails a request


def record_all(event: str, req_ids: Any, failed: Any = None) -> None:
    """``event`` for every id in ``req_ids`` (any iterable; None for none); those also in
    ``failed`` are marked so."""
    if _path is None or not req_ids:
        return
    for req_id in req_ids:
        if failed and req_id in failed:
            record(event, str(req_id), failed=True)
        else:
            record(event, str(req_id))


def set_path(path: str | None) -> None:
    """Record to ``path`` from now on in this process (None: stop); for tests and tools."""
    global _path
    _path = path or None
