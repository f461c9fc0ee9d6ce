"""Test-only: flip bytes of KV in flight, in every Python process that starts with this
directory first on ``PYTHONPATH`` and ``VLLM_HYBRID_NIXL_TEST_CORRUPT`` naming a control file.

The control file is JSON ``{"where": "received" | "source", "kind": KIND, "left": N}``: the
next N reads that move a page of a KV-cache group of that kind (``full_attention``,
``sliding_window``, ``mamba``) are corrupted, one byte each, then ``left`` is written back.

- ``received``: on the decode worker, one byte of the first page of that group it received,
  after NIXL wrote it and before the digest check reads it.
- ``source``: on the prefill worker, one byte of the first page of that group, right after
  the prefill digested it (so the decode reads other bytes than were digested); the byte is
  put back when the prefill worker reports the request's blocks sent (the read is over, the
  blocks not yet freed). Use prompts shorter than a block, or no prefix caching: a re-run
  must not hit the damaged page in the prefill's prefix cache.
- ``after-check``: on the decode worker, every received page of that group is overwritten
  after the digest check passed: the negative control, showing such damage gives wrong tokens
  when nothing catches it.

It wraps ``DigestGuardMixin.received_digests`` and ``_digest_source`` once the module is
imported. Never shipped: it lives in ``tests/harness``, outside the wheel.
"""

from __future__ import annotations

import fcntl
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading

TARGET = "vllm_hybrid_nixl.connector.digest_guard"
CONTROL = os.environ.get("VLLM_HYBRID_NIXL_TEST_CORRUPT")
_lock = threading.Lock()
_restore: dict[str, tuple[object, int, int]] = {}


def _take(where: str, kinds: list[str]) -> str | None:
    """The group kind to corrupt now (and one fewer left), or None. The ranks of a TP > 1
    engine are processes of their own: the control file is read and rewritten under an
    exclusive lock on it, so one corruption is taken once."""
    with _lock:
        try:
            handle = open(CONTROL, "r+")  # noqa: SIM115 - held for the lock below
        except OSError:
            return None
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                control = json.loads(handle.read())
            except ValueError:
                return None
            if control.get("where") != where or int(control.get("left", 0)) <= 0:
                return None
            if control.get("kind") not in kinds:
                return None
            control["left"] = int(control["left"]) - 1
            control["done"] = int(control.get("done", 0)) + 1
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(control))
            handle.flush()
            return str(control["kind"])


def _flip(worker, group: int, page: int) -> tuple[object, int, int]:
    """Flip one byte in the middle of kernel page ``page`` of the group's first layer."""
    entry = worker._digester._groups[group][0]
    geometry = entry.geometry
    offset, length = geometry.pieces[0]
    where = geometry.base + page * geometry.stride + offset + length // 2
    before = int(entry.storage[where])
    entry.storage[where] = before ^ 0x5A
    return entry.storage, where, before


def _overwrite(worker, group: int, page: int) -> None:
    """Overwrite every moved byte of kernel page ``page`` in every layer of the group."""
    for entry in worker._digester._groups[group]:
        geometry = entry.geometry
        for offset, length in geometry.pieces:
            start = geometry.base + page * geometry.stride + offset
            entry.storage[start : start + length] = 0x3C


def _group_of_kind(worker, kind: str, pages_by_group) -> int | None:
    for group, pages in enumerate(pages_by_group):
        if pages and worker._digest_kinds[group] == kind:
            return group
    return None


def _patch(module) -> None:
    mixin = module.DigestGuardMixin
    received, source = mixin.received_digests, mixin._digest_source

    def corrupting_received(self, req_id, reads):
        kinds = [self._digest_kinds[g] for r in reads for g, p in enumerate(r.local) if p]
        kind = _take("received", kinds)
        if kind is not None:
            group = _group_of_kind(self, kind, reads[0].local)
            if group is not None:
                _flip(self, group, reads[0].local[group][0])
                print(
                    f"vllm-hybrid-nixl test hook: corrupted a received {kind} page of {req_id}",
                    file=sys.stderr,
                    flush=True,
                )
        return received(self, req_id, reads)

    def corrupting_source(self, req_id, blocks):
        source(self, req_id, blocks)
        pages = module.kernel_pages(blocks, self._digest_ratios)
        kind = _take("source", [self._digest_kinds[g] for g, p in enumerate(pages) if p])
        if kind is None:
            return
        group = _group_of_kind(self, kind, pages)
        if group is None:
            return
        with _lock:
            _restore[req_id] = _flip(self, group, pages[group][0])
        print(
            f"vllm-hybrid-nixl test hook: corrupted a {kind} source page of {req_id}",
            file=sys.stderr,
            flush=True,
        )

    def restoring_results(self):
        results = results_of(self)
        for req_id in results.finished_sending or ():
            with _lock:
                damaged = _restore.pop(req_id, None)
            if damaged is not None:  # read and reported sent; not freed before this returns
                storage, where, before = damaged
                storage[where] = before
        return results

    def damaging_report(self, results, req_id, problem, check):
        reads = check.reads if check is not None else None
        if not problem and reads:
            kinds = [self._digest_kinds[g] for g, p in enumerate(reads[0].local) if p]
            kind = _take("after-check", kinds)
            if kind is not None:
                group = _group_of_kind(self, kind, reads[0].local)
                _overwrite(self, group, reads[0].local[group][0])
                print(
                    f"vllm-hybrid-nixl test hook: overwrote a received {kind} page of "
                    f"{req_id} after its check",
                    file=sys.stderr,
                    flush=True,
                )
        return report(self, results, req_id, problem, check)

    results_of = mixin.get_transfer_results
    report = mixin._report
    mixin.received_digests = corrupting_received
    mixin._digest_source = corrupting_source
    mixin._report = damaging_report
    mixin.get_transfer_results = restoring_results


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)
            print(
                f"vllm-hybrid-nixl test hook: KV corruption armed (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )

        loader.exec_module = exec_module
        return spec


if CONTROL:
    sys.meta_path.insert(0, _PatchAfterLoad())
