"""The end-to-end KV digest, on both workers: the decode engine samples only from KV whose
bytes are the bytes the prefill engine computed.

Prefill worker (every rank): the next step the scheduler builds after a request finishes
with its blocks kept for a decode engine (two steps later under async scheduling) names the
request's blocks on the connector metadata (:data:`SOURCES_ATTRIBUTE`); the worker digests
every kernel page of them, per KV-cache group (:mod:`.kv_digest`), when that metadata is
bound, before the step's forward, and serves the digests on its digest port
(:mod:`~vllm_hybrid_nixl.protocol.digest_wire`) until the decode's read is long over.

Decode worker (every rank): the pages each read moved are recorded as vLLM's own read path
computes them (after its prefix-cache trim). When vLLM reports the read complete, the worker
digests the pages it received, holds the request back from the scheduler, and asks the
prefill rank it read from for that rank's digests (in the background: other requests go on).
Equal digests release the request to be scheduled; a difference, a missing digest or no
usable answer within ``kv_digest_timeout`` makes the read a failed KV load
(``failed_recving``): vLLM then fails the request or computes the prompt itself
(``kv_load_failure_policy``), and never caches what it received. The decode scheduler names
what to ask on the metadata (:data:`EXPECT_ATTRIBUTE`, from the prefill's lease value);
a prefill engine that sends no digest port (a stock peer, an older release of ours,
``kv_digest: false``) is named once in the log: its reads are unverified.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_hybrid_nixl.common.netutil import DIGEST_PORT_OFFSET
from vllm_hybrid_nixl.connector import compat, kv_timeline
from vllm_hybrid_nixl.connector.digest_metrics import stats_classes
from vllm_hybrid_nixl.connector.extra_settings import strict_bool
from vllm_hybrid_nixl.connector.kv_digest import CellPlan, PageDigester, plan_cells
from vllm_hybrid_nixl.protocol.digest_wire import (
    MAX_SPLIT_GROUPS,
    DigestAsker,
    DigestAskFailed,
    DigestServer,
    GroupDigests,
    Split,
    endpoint_of,
)
from vllm_hybrid_nixl.protocol.layout import MAMBA_KIND, LayoutForm
from vllm_hybrid_nixl.protocol.tp_split import read_part

logger = logging.getLogger("vllm.hybrid_nixl.digest")

#: ``kv_connector_extra_config`` keys.
DIGEST_KEY = "kv_digest"  # true (default) or false
DIGEST_TIMEOUT_KEY = "kv_digest_timeout"  # seconds a decode waits for the prefill's digests
DEFAULT_DIGEST_TIMEOUT_S = 10.0
#: Connector-metadata attributes the schedulers hand their workers.
SOURCES_ATTRIBUTE = "hybrid_digest_sources"  # prefill: {request: logical blocks per group}
EXPECT_ATTRIBUTE = "hybrid_digest_expect"  # decode: {request: where its digests are}
#: A prefill worker keeps a request's digests this long after computing them, at most
#: :data:`AFTER_SENT_S` after its blocks were reported sent, within a count and a byte budget.
KEEP_S = 900.0
AFTER_SENT_S = 60.0
MAX_KEPT = 100_000
MAX_BYTES = 512 << 20  # cells of split reads included (MAX_CELLS in .kv_digest)
#: A question sent as a read starts may wait this many ``kv_digest_timeout`` for its answer.
PREFETCH_DEADLINE_FACTOR = 3
#: Completed reads a decode worker remembers while they wait to be reported (never reported:
#: notify-only reads, aborts); the oldest are dropped beyond this.
MAX_TRACKED = 10_000


class DigestSettingError(ValueError):
    """A ``kv_digest`` / ``kv_digest_timeout`` value that is not usable."""


def digest_enabled(kv_transfer_config: Any) -> bool:
    """``kv_digest`` from ``kv_connector_extra_config`` (default true)."""
    if kv_transfer_config is None:
        return False
    meaning = "true verifies every KV read byte for byte; false turns the check off"
    return strict_bool(kv_transfer_config, DIGEST_KEY, True, meaning, DigestSettingError)


def digest_timeout(kv_transfer_config: Any) -> float:
    value = kv_transfer_config.get_from_extra_config(DIGEST_TIMEOUT_KEY, DEFAULT_DIGEST_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 3600:
        raise DigestSettingError(
            f"kv_connector_extra_config {DIGEST_TIMEOUT_KEY} is {value!r}; expected seconds "
            f"between 0 and 3600 (default {DEFAULT_DIGEST_TIMEOUT_S:g})"
        )
    return float(value)


def digest_port_base(vllm_config: Any) -> int:
    """The first digest port of this engine (its TP rank 0): side-channel port +
    :data:`DIGEST_PORT_OFFSET` + data-parallel rank x TP size."""
    _, side_port = compat.side_channel_env()
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return side_port + DIGEST_PORT_OFFSET + compat.data_parallel_index(vllm_config) * tp_size


def kernel_pages(block_ids: Sequence[Sequence[int]], ratios: Sequence[int]) -> list[list[int]]:
    """Logical block ids per group -> kernel page ids (``ratio`` pages per block)."""
    return [
        [block * ratio + k for block in group for k in range(ratio)]
        for group, ratio in zip(block_ids, ratios, strict=True)
    ]


@dataclass
class _Read:
    """One NIXL read of a request: the remote rank and the kernel pages per group."""

    remote_rank: int
    local: list[list[int]]
    remote: list[list[int]]
    engine: str = "?"  # the prefill engine read from
    split: Split | None = None  # groups read as a part of each remote page (a larger TP)


@dataclass
class _Check:
    """A completed read waiting for the prefill's digests."""

    reads: list[_Read]
    local: list[dict[int, np.ndarray]]  # per read: group -> received pages' lanes
    endpoints: dict[int, str]  # remote TP rank -> its digest service
    engine: str
    remote_req: str
    started: float = field(default_factory=time.monotonic)
    answers: dict[int, dict[int, GroupDigests]] = field(default_factory=dict)
    answered: float = 0.0
    unverified: list[str] = field(default_factory=list)  # groups the prefill could not cut

    @property
    def where(self) -> str:
        return f"prefill request {self.remote_req} on engine {self.engine}"


class DigestTable:
    """A prefill worker's digests by request: kept until :data:`AFTER_SENT_S` after vLLM
    reported the request's blocks sent (the decode asks right after its read), else
    :data:`KEEP_S`, and within :data:`MAX_KEPT` entries and :data:`MAX_BYTES`; thread-safe
    (the digest service reads it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, dict[int, GroupDigests]]] = OrderedDict()
        self._sent: deque[tuple[float, str]] = deque()
        self._bytes = 0

    @staticmethod
    def _size(digests: dict[int, GroupDigests]) -> int:
        return sum(
            d.pages.nbytes + d.lanes.nbytes + (0 if d.cells is None else d.cells.nbytes)
            for d in digests.values()
        )

    def _drop(self, req_id: str) -> None:
        entry = self._entries.pop(req_id, None)
        if entry is not None:
            self._bytes -= self._size(entry[1])

    def put(self, req_id: str, digests: dict[int, GroupDigests]) -> None:
        now = time.monotonic()
        with self._lock:
            self._drop(req_id)
            self._entries[req_id] = (now, digests)
            self._bytes += self._size(digests)
            while self._sent and self._sent[0][0] < now:
                self._drop(self._sent.popleft()[1])
            while self._entries and (
                len(self._entries) > MAX_KEPT
                or self._bytes > MAX_BYTES
                or next(iter(self._entries.values()))[0] < now - KEEP_S
            ):
                self._drop(next(iter(self._entries)))

    def sent(self, req_ids: Iterable[str]) -> None:
        """vLLM reported these requests' blocks sent: forget them soon."""
        deadline = time.monotonic() + AFTER_SENT_S
        with self._lock:
            self._sent.extend((deadline, r) for r in req_ids if r in self._entries)

    def get(self, req_id: str) -> dict[int, GroupDigests] | None:
        with self._lock:
            entry = self._entries.get(req_id)
        return entry[1] if entry is not None else None


class DigestGuardMixin:
    """Worker: digest on the prefill rank, check on the decode rank (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        worker: Any = self
        config = worker.vllm_config.kv_transfer_config
        self._digest_on = digest_enabled(config) and compat.digest_hooks_available()
        if digest_enabled(config) and not self._digest_on:
            logger.warning(
                "vllm-hybrid-nixl: the KV digest is not available on %s (its NIXL worker "
                "reads through other methods); KV reads are not verified byte for byte",
                compat.installed_release_text(),
            )
        self._digest_timeout_s = digest_timeout(config)
        self._digester: PageDigester | None = None
        self._digest_ratios: list[int] = []
        self._digest_kinds: list[str] = []
        self._digest_table = DigestTable()
        self._digest_server: DigestServer | None = None
        self._digest_expect: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._digest_reads: OrderedDict[str, list[_Read]] = OrderedDict()
        self._digest_reading: str | None = None
        self._digest_checks: dict[str, _Check] = {}
        self._digest_asker = DigestAsker()
        self._digest_unverified_warned: set[str] = set()
        self._digest_verified_told: set[str] = set()
        self.digest_verified = 0
        self.digest_mismatches = 0
        classes = stats_classes()
        if self._digest_on and classes is not None and hasattr(worker, "xfer_stats"):
            worker.xfer_stats = classes[0]()  # counts mismatches for the engine's /metrics

    # ---- both roles: what to digest --------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        if not self._digest_on:
            return
        worker: Any = self
        layers = [
            (item.layer.group_id, kv_caches[item.layer.name], item)
            for item in worker.validated_layers
        ]
        self._digester = PageDigester(layers, self._cell_plans())
        groups = 1 + max((item.layer.group_id for item in worker.validated_layers), default=-1)
        kinds = {item.layer.group_id: item.layer.spec_kind for item in worker.validated_layers}
        self._digest_kinds = [kinds.get(g, "?") for g in range(groups)]
        ratio = int(worker._physical_blocks_per_logical_kv_block)
        self._digest_ratios = [1 if kind == MAMBA_KIND else ratio for kind in self._digest_kinds]
        if worker.kv_transfer_config.is_kv_producer:
            self._start_digest_service()

    def _cell_plans(self) -> dict[int, CellPlan]:
        """The regions a read by another TP size cuts from each group's pages, as vLLM's
        NIXL worker cuts them: an attention page's heads (where a block-contiguous layout
        keeps them one after the other and nothing is permuted after a read; a K/V-split
        cache has a K and a V page), a Mamba state page's conv sub-projections and temporal
        state. Groups without one (or whose pages the plan does not fit) are digested whole
        only."""
        worker: Any = self
        state = compat.state_regions(worker)
        heads_contiguous = compat.attention_heads_contiguous(worker)
        by_group: dict[int, list[Any]] = {}
        for item in worker.validated_layers:
            by_group.setdefault(item.layer.group_id, []).append(item)
        plans: dict[int, CellPlan] = {}
        for group, items in by_group.items():
            regions: list[list[tuple[int, int]]] | None = None
            if items[0].layer.spec_kind == MAMBA_KIND:
                regions = [state] if state else None
            elif heads_contiguous and all(i.form is LayoutForm.KV_SPLIT for i in items):
                half = items[0].physical_page_size // 2
                regions = [[(0, half)], [(0, half)]]  # a K page and a V page
            elif heads_contiguous:
                regions = [[(0, items[0].physical_page_size)]]  # heads, K and V inside each
            plan = plan_cells(regions) if regions else None
            if plan is not None:
                plans[group] = plan
        return plans

    def _start_digest_service(self) -> None:
        """Serve this rank's digests on its derived port. A port that cannot be had is an
        ERROR, not a refusal: the engine serves, and decode engines fail (never use) its
        reads, each naming the port — two producer workers in one process (test harnesses)
        meet this, a deployment should not."""
        worker: Any = self
        host, _ = compat.side_channel_env()
        port = digest_port_base(worker.vllm_config) + int(worker.tp_rank)
        try:
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is out of range")
            self._digest_server = _bind_with_retries(self._digest_table.get, host, port)
        except Exception as exc:  # noqa: BLE001 - said loudly, and every read fails closed
            logger.error(
                "vllm-hybrid-nixl: the KV digest service of TP rank %s could not listen on "
                "%s:%s (%s); it listens on the NIXL side-channel port + %d + the rank. Decode "
                "engines will fail every read from this engine (not one is used unverified). "
                "What to change: give this engine a VLLM_NIXL_SIDE_CHANNEL_PORT whose +%d "
                "ports are free, or stop what holds the port, or set %s: false in "
                "kv_connector_extra_config on both engines (reads are then not verified).",
                worker.tp_rank,
                host,
                port,
                exc,
                DIGEST_PORT_OFFSET,
                DIGEST_PORT_OFFSET,
                DIGEST_KEY,
            )
            return
        logger.info(
            "vllm-hybrid-nixl: KV digest service of TP rank %d on %s",
            worker.tp_rank,
            self._digest_server.endpoint,
        )

    def shutdown(self) -> None:
        """Free the digest port and connections, then vLLM's own shutdown."""
        if self._digest_server is not None:
            self._digest_server.close()
            self._digest_server = None
        self._digest_asker.close()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()

    def digest_pages(
        self, pages: Sequence[Sequence[int]], split: Split | None = None
    ) -> dict[int, np.ndarray]:
        """Group -> ``[n, 2]`` lanes of the given kernel pages of this worker's caches; a
        group in ``split`` is digested as that part of each larger remote page."""
        assert self._digester is not None
        lanes: dict[int, np.ndarray] = {}
        for group, ids in enumerate(pages):
            if not ids or group not in self._digester.groups:
                continue
            if split and group in split:
                ratio, part, _ = split[group]
                lanes[group] = self._digester.digest_mapped(group, list(ids), ratio, part)
            else:
                lanes[group] = self._digester.digest(group, list(ids))
        return lanes

    # ---- prefill rank ---------------------------------------------------------------------

    def digest_sources(self, metadata: Any) -> None:
        """Digest the blocks this step's metadata names (once: the names are taken off).
        The connector calls this when the step's metadata is bound, before the forward:
        vLLM 0.32 calls ``start_load_kv`` after launching the forward, which on CPU is after
        the whole forward has run, and a decode engine waiting for these digests waited that
        long (measured: up to 0.9 s behind a prefill of 4k tokens)."""
        sources = getattr(metadata, SOURCES_ATTRIBUTE, None)
        if self._digester is None or not sources:
            return
        setattr(metadata, SOURCES_ATTRIBUTE, None)
        for req_id, blocks in sources.items():
            self._digest_source(req_id, blocks)

    def start_load_kv(self, metadata: Any) -> Any:
        if self._digester is not None:
            self.digest_sources(metadata)  # done already where the connector bound it
            expect = getattr(metadata, EXPECT_ATTRIBUTE, None)
            if expect:
                self._digest_expect.update(expect)
                _bound(self._digest_expect)
        return super().start_load_kv(metadata)  # type: ignore[misc]

    def _read_split(self, engine: str) -> Split | str | None:
        """How this rank's reads from prefill engine ``engine`` cut its pages: None for
        whole pages (the same TP size), the part per group for a smaller prefill TP, or
        why those reads cannot be verified. The prefill's TP size is the one recorded when
        the handshake with it succeeded (:attr:`peer_tp_sizes`)."""
        worker: Any = self
        try:
            own = int(worker.vllm_config.parallel_config.tensor_parallel_size)
            remote = worker.peer_tp_sizes.get(engine)
            if remote is None or remote == own or self._digester is None:
                return None
            return self._split_parts(own, int(remote))
        except Exception as exc:  # noqa: BLE001 - never raise out of vLLM's read path
            return f"its split could not be worked out ({exc!r:.200})"

    def _split_parts(self, own: int, remote: int) -> Split | str | None:
        worker: Any = self
        assert self._digester is not None
        where = f"another tensor-parallel size (prefill {remote}, decode {own})"
        if compat.reads_rearranged_after_transfer(worker):
            return f"{where}: vLLM rearranges the received KV after the read"
        heads = compat.transfer_kv_heads(worker)
        split: Split = {}
        for group, kind in enumerate(self._digest_kinds):
            part = read_part(kind == MAMBA_KIND, own, remote, int(worker.tp_rank), heads)
            if isinstance(part, str):
                return f"{where}: {part}"
            ratio, index = part
            if ratio == 1:
                continue  # read whole
            plan = self._digester.plan(group)
            if plan is None:
                return (
                    f"{where}: KV-cache group {group} ({kind}) has no layout the split "
                    "digest follows (attention heads contiguous in a page, or a Mamba "
                    "state vLLM cuts into its conv parts)"
                )
            split[group] = (ratio, index, plan.region_count)
        if len(split) > MAX_SPLIT_GROUPS:
            return f"{where}: {len(split)} groups read in parts (at most {MAX_SPLIT_GROUPS})"
        return split or None

    def _digest_source(self, req_id: str, blocks: Sequence[Sequence[int]]) -> None:
        """Digest a finished request's pages for the decode's question: whole pages, and
        per cell where the group has a cell plan (for a decode of a larger TP)."""
        assert self._digester is not None
        kept: dict[int, GroupDigests] = {}
        try:
            pages = kernel_pages(blocks, self._digest_ratios)
            for group, ids in enumerate(pages):
                if ids and group in self._digester.groups:
                    lanes, cells = self._digester.digest_cells(group, list(ids))
                    kept[group] = GroupDigests(np.asarray(ids, dtype=np.int64), lanes, cells)
        except Exception:  # noqa: BLE001 - a digest it cannot make is one the decode lacks
            logger.exception("vllm-hybrid-nixl: could not digest request %s's KV", req_id)
            return
        self._digest_table.put(req_id, kept)

    # ---- decode rank: which pages each read moved ------------------------------------------

    def _read_blocks(self, *args: Any, **kwargs: Any) -> Any:
        if not self._digest_on:
            return super()._read_blocks(*args, **kwargs)  # type: ignore[misc]
        # (read_spec, dst_engine_id, request_id, ...) as digest_hooks_available checked
        named = dict(zip(("read_spec", "dst_engine_id", "request_id"), args, strict=False))
        named.update(
            {k: kwargs[k] for k in ("read_spec", "dst_engine_id", "request_id") if k in kwargs}
        )
        read_spec, request_id = named["read_spec"], str(named["request_id"])
        if not any(len(group) for group in read_spec.local_block_ids):
            # Notify-only (a full local prefix hit, an aborted request): nothing is moved,
            # and vLLM never reports it finished.
            self._digest_expect.pop(request_id, None)
            return super()._read_blocks(*args, **kwargs)  # type: ignore[misc]
        split = self._read_split(str(named["dst_engine_id"]))
        if getattr(read_spec, "block_ids_by_region", False) or isinstance(split, str):
            # Region-mapped (MLA caches grouped differently on the two sides): ids are per
            # NIXL region, not per KV-cache group, so page digests cannot be paired.
            expect = self._digest_expect.get(request_id)
            if expect is not None and expect.get("port"):
                expect["why"] = (
                    split
                    if isinstance(split, str)
                    else "region-mapped reads (MLA layouts grouped differently)"
                )
                expect.pop("port", None)
                self._warn_unverified(request_id, expect, str(named["dst_engine_id"]))
            return super()._read_blocks(*args, **kwargs)  # type: ignore[misc]
        reads = self._digest_reads.setdefault(request_id, [])
        reads.append(
            _Read(
                int(read_spec.remote_rank),
                [list(g) for g in read_spec.local_block_ids],
                [list(g) for g in read_spec.remote_block_ids],
                str(named["dst_engine_id"]),
                split,
            )
        )
        _bound(self._digest_reads)
        if len(reads) == 1:
            self._prefetch(request_id, int(read_spec.remote_rank), split)
        self._digest_reading = request_id
        try:
            return super()._read_blocks(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._digest_reading = None

    def _apply_prefix_caching(self, *args: Any, **kwargs: Any) -> Any:
        local, remote = super()._apply_prefix_caching(*args, **kwargs)  # type: ignore[misc]
        reading = self._digest_reading
        if reading is not None and self._digest_reads.get(reading):
            read = self._digest_reads[reading][-1]
            read.local = [list(g) for g in local]
            read.remote = [list(g) for g in remote]
        return local, remote

    # ---- decode rank: the check -------------------------------------------------------------

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()  # type: ignore[misc]
        kv_timeline.record_all("read_done", results.finished_recving, results.failed_recving)
        if not self._digest_on:
            return results
        if results.finished_sending:
            self._digest_table.sent(results.finished_sending)
        for req_id in list(results.finished_recving):
            reads = self._digest_reads.pop(req_id, None)
            expect = self._digest_expect.pop(req_id, None)
            if req_id in results.failed_recving:
                if expect is not None and expect.get("port") and reads:
                    for rank in {read.remote_rank for read in reads}:
                        self._digest_asker.forget(_endpoint(expect, rank), str(expect["req"]))
                continue
            if not reads:
                if expect is not None and expect.get("port"):
                    self._warn_unverified(
                        req_id,
                        {"why": "its read took a path the digest does not see (report this)"},
                        str(expect.get("engine", "?")),
                    )
                continue
            if expect is None or not expect.get("port"):
                self._warn_unverified(req_id, expect, reads[0].engine)
                continue
            results.finished_recving.discard(req_id)
            try:
                self._digest_checks[req_id] = self._start_check(req_id, reads, expect)
            except Exception as exc:  # noqa: BLE001 - a read it cannot check is not used
                self._report(
                    results,
                    req_id,
                    self._failure(
                        req_id,
                        str(expect.get("req")),
                        f"its received KV could not be digested: {exc!r:.300}",
                    ),
                    None,
                )
        try:
            self._digest_asker.poll()
        except Exception:  # noqa: BLE001 - unanswered checks fail by their deadlines
            logger.exception("vllm-hybrid-nixl: collecting KV digest answers failed")
        now = time.monotonic()
        for req_id, check in list(self._digest_checks.items()):
            try:
                if not self._collect(check) and now <= check.started + self._digest_timeout_s:
                    continue
                del self._digest_checks[req_id]
                if len(check.answers) < len(check.endpoints):
                    raise DigestAskFailed(
                        f"no answer within {self._digest_timeout_s:g} s (kv_digest_timeout)"
                    )
                problem = self._verdict(req_id, check)
            except DigestAskFailed as exc:
                self._digest_checks.pop(req_id, None)
                problem = self._failure(
                    req_id, check.where, f"no usable KV digest came back: {exc}"
                )
            except Exception as exc:  # noqa: BLE001 - never raise out of the engine's step
                self._digest_checks.pop(req_id, None)
                problem = self._failure(
                    req_id, check.where, f"its digests could not be compared: {exc!r:.300}"
                )
            if req_id not in self._digest_checks:
                for endpoint in check.endpoints.values():
                    self._digest_asker.forget(endpoint, check.remote_req)
                self._report(results, req_id, problem, check)
        return results

    def _collect(self, check: _Check) -> bool:
        """Take the answers that came in; True once every rank answered (raises
        :class:`DigestAskFailed` for a rank whose question failed)."""
        for rank, endpoint in check.endpoints.items():
            if rank not in check.answers:
                found = self._digest_asker.answer(endpoint, check.remote_req)
                if found is not None:
                    check.answers[rank] = found
                    check.answered = time.monotonic()
        return len(check.answers) == len(check.endpoints)

    def _report(self, results: Any, req_id: str, problem: str, check: _Check | None) -> None:
        """Hand a checked read to the scheduler: done, and failed when ``problem``."""
        results.finished_recving.add(req_id)
        if problem:
            results.failed_recving.add(req_id)
            self._count_mismatch()
            logger.error("%s", problem)
            return
        if check is None:
            return
        engine = check.engine
        if check.unverified:  # used, as from a peer without digests, and said so
            self._warn_unverified(req_id, {"why": "; ".join(check.unverified)}, engine)
            return
        self.digest_verified += 1
        answered = (check.answered - check.started) * 1e3
        reported = (time.monotonic() - check.started) * 1e3
        timing = f"digests taken {answered:.1f} ms and reported {reported:.1f} ms after the read"
        if engine not in self._digest_verified_told:
            self._digest_verified_told.add(engine)
            logger.info(
                "vllm-hybrid-nixl: KV reads from prefill engine %s are verified byte for byte "
                "(first: request %s, %s)",
                engine,
                req_id,
                timing,
            )
        else:
            logger.debug("vllm-hybrid-nixl: request %s verified (%s)", req_id, timing)

    def received_digests(self, req_id: str, reads: list[_Read]) -> list[dict[int, np.ndarray]]:
        """The received pages' digests, read by read (the corruption tests wrap this): a
        group read as a part of each remote page is digested as that part."""
        return [self.digest_pages(read.local, read.split) for read in reads]

    def _start_check(self, req_id: str, reads: list[_Read], expect: dict[str, Any]) -> _Check:
        local = self.received_digests(req_id, reads)
        started = time.monotonic()
        splits = {read.remote_rank: read.split for read in reads}
        endpoints = {rank: _endpoint(expect, rank) for rank in sorted(splits)}
        remote_req = str(expect["req"])
        for rank, endpoint in endpoints.items():  # under way already when prefetched
            deadline = started + self._digest_timeout_s
            self._digest_asker.ask(endpoint, remote_req, deadline, splits[rank])
        return _Check(reads, local, endpoints, str(expect.get("engine", "?")), remote_req, started)

    def _prefetch(self, request_id: str, remote_rank: int, split: Split | None) -> None:
        """Ask for the digests as the read starts, so they are in when it completes (the
        answer does not depend on the read; the prefill digests when the step after the
        request's last one binds its metadata, before its forward, so the digests are
        usually in before the read; until then the asker asks again). Its
        deadline leaves the read time to finish; the check's own deadline counts from the
        read's completion."""
        expect = self._digest_expect.get(request_id)
        if expect is None or not expect.get("port"):
            return
        endpoint = _endpoint(expect, remote_rank)
        deadline = time.monotonic() + PREFETCH_DEADLINE_FACTOR * self._digest_timeout_s
        self._digest_asker.ask(endpoint, str(expect["req"]), deadline, split)

    def _verdict(self, req_id: str, check: _Check) -> str:
        """Empty when every received page equals the prefill's; else the error message."""
        where = check.where
        fetched = check.answers
        for read, local in zip(check.reads, check.local, strict=True):
            remote_groups = fetched.get(read.remote_rank, {})
            for group, lanes in local.items():
                wanted = remote_groups.get(group)
                if wanted is not None and wanted.unverifiable:
                    check.unverified.append(
                        f"the prefill could not give KV-cache group {group}'s part of its "
                        f"pages ({wanted.unverifiable})"
                    )
                    continue
                known = wanted.of() if wanted is not None else {}
                if len(read.remote[group]) != len(lanes):
                    return self._failure(
                        req_id,
                        where,
                        f"group {group}: {len(read.local[group])} pages read into "
                        f"{len(read.remote[group])} remote pages cannot be paired",
                    )
                for index, page in enumerate(read.remote[group]):
                    expected = known.get(int(page))
                    got = (int(lanes[index][0]), int(lanes[index][1]))
                    if expected == got:
                        continue
                    ratio = self._digest_ratios[group]
                    kind = self._digest_kinds[group]
                    what = "has no digest for it" if expected is None else "computed other bytes"
                    return self._failure(
                        req_id,
                        where,
                        f"the KV bytes received differ from the prefill engine's in KV-cache "
                        f"group {group} ({kind}), first at logical block {int(page) // ratio} "
                        f"(kernel page {int(page)}, read into local page "
                        f"{read.local[group][index]}) from TP rank {read.remote_rank}: the "
                        f"prefill {what}",
                    )
        return ""

    def _failure(self, req_id: str, where: str, cause: str) -> str:
        worker: Any = self
        policy = compat.kv_load_failure_policy(worker.kv_transfer_config)
        outcome = "is recomputed on this engine" if policy == "recompute" else "fails"
        return (
            f"vllm-hybrid-nixl: KV digest mismatch for request {req_id} ({where}): {cause}. "
            f"Nothing received for it is used or cached; the request {outcome} "
            f"(kv_load_failure_policy={policy}). What to change: nothing for a single event "
            "(the router re-runs a failed request on a fresh prefill); if it repeats, check "
            "the prefill and decode engines' NIXL/UCX transport and report it with both logs."
        )

    def _count_mismatch(self) -> None:
        self.digest_mismatches += 1
        worker: Any = self
        compat.record_digest_mismatch(getattr(worker, "xfer_stats", None))

    def _warn_unverified(self, req_id: str, expect: dict[str, Any] | None, engine: str) -> None:
        """Say once per prefill engine and reason that its reads are used unverified."""
        why = (expect or {}).get("why") or (
            "it sends no KV digest (a stock NixlConnector, an older vllm-hybrid-nixl, "
            "kv_digest: false on it, or lease_guard: false on either engine: the digest's "
            "port travels in the lease value)"
        )
        key = f"{engine}\n{why[:120]}"
        if key in self._digest_unverified_warned:
            return
        if len(self._digest_unverified_warned) < MAX_TRACKED:
            self._digest_unverified_warned.add(key)
        logger.warning(
            "vllm-hybrid-nixl: KV reads from prefill engine %s are NOT verified byte for byte: "
            "%s; first seen on request %s",
            engine,
            why,
            req_id,
        )


#: A derived digest port held by a short-lived connection is asked for again this long.
BIND_RETRY_S = 2.0


def _bind_with_retries(lookup: Any, host: str, port: int) -> DigestServer:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return DigestServer(lookup, host, port)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _endpoint(expect: dict[str, Any], rank: int) -> str:
    """The digest service of prefill TP rank ``rank``, from the scheduler's expectation."""
    return endpoint_of(str(expect["host"]), int(expect["port"]) + rank)


def _bound(entries: OrderedDict) -> None:
    """Drop the oldest entries beyond :data:`MAX_TRACKED`."""
    while len(entries) > MAX_TRACKED:
        entries.popitem(last=False)
