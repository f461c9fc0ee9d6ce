"""NIXL workers whose ``register_kv_caches`` understands the hybrid memory allocator.

``register_kv_caches`` = describe every layer (plain data) -> run the HMA-aware
layout check (:mod:`vllm_hybrid_nixl.protocol.layout`) -> hand vLLM's own registration
block-major ``[NB*r, PS/r]`` views of the validated tensors, the one form every
supported release registers byte-correctly.  Registration itself stays vLLM's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from vllm_hybrid_nixl.connector import compat, kv_timeline, thread_priority
from vllm_hybrid_nixl.connector.cpu_amx import ask_for_amx_tiles
from vllm_hybrid_nixl.connector.digest_guard import DigestGuardMixin
from vllm_hybrid_nixl.connector.extra_settings import strict_bool
from vllm_hybrid_nixl.connector.kv_cache_facts import (
    describe_cache,
    fingerprint_of,
    spec_kind,
    state_bytes,
)
from vllm_hybrid_nixl.connector.lease import LeaseReaderMixin
from vllm_hybrid_nixl.connector.progress_pacing import DEFAULT_POLL_US, POLL_KEY, paced_agents
from vllm_hybrid_nixl.connector.registration_audit import AuditSummary, audit_registration
from vllm_hybrid_nixl.connector.thread_care import ProgressThreadCare
from vllm_hybrid_nixl.protocol.fingerprint import (
    LayoutFingerprint,
    LayoutMismatchError,
    StockPeerError,
    compare_with_peer,
    mismatch_message,
    stock_peer_message,
)
from vllm_hybrid_nixl.protocol.handshake_probe import ProbeError, fetch_compat_string
from vllm_hybrid_nixl.protocol.layout import (
    MAMBA_KIND,
    HybridLayoutError,
    LayerDescription,
    LayoutForm,
    ValidatedLayer,
    check_layout,
)

# A child of the "vllm" logger, so vLLM's log handlers and level apply in every process.
logger = logging.getLogger("vllm.hybrid_nixl.worker")

#: Reads of the peer's side channel before a handshake gives up, and each read's deadline. A
#: first handshake between engines busy on shared cores (a TP2 engine starting beside its peer
#: on two cores) can miss a deadline; this runs in vLLM's handshake thread, so waiting longer
#: stalls no engine step, and a request refused for a slow answer costs more.
PEER_PROBE_ATTEMPTS = 3
PEER_PROBE_TIMEOUT_S = 10.0

_NIXL = compat.nixl_classes()


def _layer_specs_and_groups(kv_cache_config: Any) -> dict[str, tuple[Any, int]]:
    """Layer name -> (its own KV-cache spec, its transfer group index)."""
    groups = getattr(kv_cache_config, "transfer_groups", None) or kv_cache_config.kv_cache_groups
    result: dict[str, tuple[Any, int]] = {}
    for group_id, group in enumerate(groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            result[name] = (per_layer.get(name, group.kv_cache_spec), group_id)
    return result


def _require_specs_or_shared(
    kv_caches: dict[str, torch.Tensor], specs: dict[str, tuple[Any, int]]
) -> None:
    """A cache without a KV-cache spec must be another layer's cache (vLLM's KV sharing:
    the same bytes as a layer that has a spec); anything else would be registered unchecked."""
    checked = {
        (cache.data_ptr(), tuple(cache.shape)) for name, cache in kv_caches.items() if name in specs
    }
    for name, cache in kv_caches.items():
        if name in specs or (cache.data_ptr(), tuple(cache.shape)) in checked:
            continue
        raise HybridLayoutError(
            f"KV cache of layer '{name}' (shape {tuple(cache.shape)}, dtype {cache.dtype}) has "
            "no KV-cache spec in vLLM's KV-cache config and is not another layer's cache, so "
            "its layout cannot be checked; NIXL would move its bytes unchecked. What to change: "
            "report this model and vLLM release to vllm-hybrid-nixl; until then run it with the "
            "stock NixlConnector at your own risk."
        )


def kernel_blocks_per_block(worker: Any) -> int:
    """r: kernel blocks per logical block, as this release's NIXL worker computed it."""
    ratio = getattr(worker, "_physical_blocks_per_logical_kv_block", None)
    if ratio is None:
        raise HybridLayoutError(
            "vLLM's NIXL worker has no _physical_blocks_per_logical_kv_block (kernel blocks "
            "per logical block); this vLLM release renamed it, and without it the layout "
            "check cannot tell [NB, PS] from [NB*r, PS/r]. What to change: use a supported "
            f"vLLM ({compat.SUPPORTED_RANGE}) or a vllm-hybrid-nixl release made for yours."
        )
    return int(ratio)


def describe_layers(
    kv_caches: dict[str, torch.Tensor], kv_cache_config: Any, ratio: int
) -> list[LayerDescription]:
    """Describe every layer that has a KV-cache spec, as plain data for the check."""
    specs = _layer_specs_and_groups(kv_cache_config)
    _require_specs_or_shared(kv_caches, specs)
    # Groups share one spec object; classify each spec once (256-layer models add up).
    spec_facts: dict[int, tuple[str, str, int, int]] = {}
    num_blocks = int(kv_cache_config.num_blocks)
    layers = []
    for name, cache in kv_caches.items():
        if name not in specs:
            continue  # no spec: it reuses another layer's cache (checked above)
        spec, group_id = specs[name]
        facts = spec_facts.get(id(spec))
        if facts is None:
            kind = spec_kind(spec)
            state = state_bytes(spec) if kind == MAMBA_KIND else 0
            facts = (kind, type(spec).__name__, int(spec.page_size_bytes), state)
            spec_facts[id(spec)] = facts
        kind, spec_type, page_size, state = facts
        layers.append(
            describe_cache(
                name,
                cache,
                spec_kind=kind,
                spec_type=spec_type,
                group_id=group_id,
                num_blocks=num_blocks,
                ratio=ratio,
                page_size=page_size,
                state_bytes=state,
            )
        )
    return layers


def physical_view(cache: torch.Tensor, validated: ValidatedLayer) -> torch.Tensor:
    """The same bytes as ``[blocks, page]`` rows: ``[NB*r, PS/r]``, or ``[NB, PS]`` for Mamba."""
    layer = validated.layer
    page = validated.physical_page_size
    blocks = layer.num_blocks if layer.spec_kind == MAMBA_KIND else layer.num_blocks * layer.ratio
    if page % cache.element_size() == 0:
        row = page // cache.element_size()
        return torch.as_strided(cache, (blocks, row), (row, 1))
    offset = cache.data_ptr() - cache.untyped_storage().data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), offset, (blocks, page), (page, 1)
    )


def progress_poll_us(kv_transfer_config: Any) -> int:
    """The progress thread's pause: ``progress_poll_us`` when set, else 0 (NIXL's spinning
    thread). Opt-in: with the pause on a TP1 -> TP2 pair, the decode ranks' first handshake
    timed out on the prefill's side channel (plain and hybrid models; the prefill engine once
    stopped answering after it), not yet explained; equal-TP pairs work with it. Raises
    ValueError naming the key for anything but a whole number >= 0
    (:data:`DEFAULT_POLL_US` is the value to use on vLLM's CPU platform)."""
    if kv_transfer_config is None:
        return 0
    value = kv_transfer_config.get_from_extra_config(POLL_KEY, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"kv_connector_extra_config {POLL_KEY} is {value!r}; expected a whole number of "
            f"microseconds >= 0 (e.g. {DEFAULT_POLL_US}; 0 keeps NIXL's busy-polling thread)"
        )
    return value


#: ``kv_connector_extra_config`` key: start a step's KV reads when its metadata is bound.
EARLY_READS_KEY = "reads_before_forward"


def reads_before_forward(kv_transfer_config: Any) -> bool:
    """``reads_before_forward`` from ``kv_connector_extra_config``; default: true on vLLM's
    CPU platform, where the forward is synchronous and vLLM's start of a step's reads "after
    the forward launch" is after the whole forward (a read then waits a step longer). There
    the zeroing of freshly allocated blocks has finished before the metadata is bound; on a
    GPU it may still be in flight on the stream, which a read started at binding could race,
    so the default there is vLLM's order."""
    on_cpu = compat.on_cpu_platform()
    if kv_transfer_config is None:
        return on_cpu
    meaning = "true starts a step's KV reads before its forward, false where vLLM does"
    value = strict_bool(kv_transfer_config, EARLY_READS_KEY, on_cpu, meaning)
    if value and not on_cpu:
        raise ValueError(
            f"kv_connector_extra_config {EARLY_READS_KEY} is true, but this engine does not "
            "run on vLLM's CPU platform: there fresh blocks may still be zeroing on the device "
            "when the step's metadata is bound, and an early read could land under it; "
            f"remove {EARLY_READS_KEY} (or set it to false)"
        )
    return value


class HybridRegistrationMixin:
    """Overrides ``register_kv_caches`` of a vLLM NIXL worker with describe -> check -> register."""

    kv_cache_config: Any
    _physical_blocks_per_logical_kv_block: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # On CPU, vLLM's NIXL worker pins the calling thread to the last core of each NUMA
        # node "for KV transfer"; that thread is the engine's compute thread, so every engine
        # on a box ends up computing on the same core. Keep the binding the engine chose.
        affinity = os.sched_getaffinity(0)
        threads_before = thread_priority.thread_ids()
        # The plugin asks for AMX tile permission in every process it loads in; an engine
        # that names this connector by module path without the plugin (VLLM_PLUGINS set to
        # others) asks here, before its first step (seen: SIGILL in the push decode worker).
        ask_for_amx_tiles(logger)
        compat.installed_vllm()  # read now (cached): the fingerprint needs it at registration
        kv_transfer_config = getattr(
            kwargs.get("vllm_config", args[0] if args else None), "kv_transfer_config", None
        )
        poll_us = progress_poll_us(kv_transfer_config)
        early_reads = reads_before_forward(kv_transfer_config)  # checked before any agent
        with paced_agents(compat.nixl_agent_class(), poll_us) as paced:
            super().__init__(*args, **kwargs)
        self.progress_poll_us = poll_us if paced else 0
        #: Whether the connector starts a step's reads when it binds the step's metadata.
        self.reads_before_forward = early_reads
        #: Prefill engines this (reading) worker completed a handshake with: their TP size,
        #: from their fingerprint (hybrids), else the one vLLM's handshake used and checked.
        self.peer_tp_sizes: dict[str, int] = {}
        self._fingerprint_tp: dict[str, int] = {}
        if paced:
            logger.info(
                "vllm-hybrid-nixl: NIXL's progress thread waits for transport events (at "
                "most %d us) instead of busy-polling a core (%s to change it)",
                poll_us,
                POLL_KEY,
            )
        elif poll_us:
            logger.warning(
                "vllm-hybrid-nixl: could not give NIXL's progress thread a pause (this NIXL's "
                "Python agent builds its native agent in a way we do not know); it busy-polls"
            )
        self._thread_care = self._care_for_new_threads(
            thread_priority.thread_ids() - threads_before
        )
        if os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
            logger.info(
                "vllm-hybrid-nixl: kept the compute thread on cores %s (vLLM's NIXL worker "
                "had moved it to the KV-transfer core)",
                sorted(affinity),
            )

    def _care_for_new_threads(self, new_threads: set[int]) -> ProgressThreadCare | None:
        """Idle priority for the busy threads vLLM's worker started, where NIXL's progress
        thread still spins (``progress_poll_us`` 0, or a NIXL whose delay we cannot set): on
        by default on vLLM's CPU platform, where it shares the engine's cores;
        ``kv_connector_extra_config`` ``idle_progress_thread`` (true/false) decides
        explicitly."""
        config = getattr(self, "kv_transfer_config", None) or getattr(
            getattr(self, "vllm_config", None), "kv_transfer_config", None
        )
        wanted = compat.on_cpu_platform() and not self.progress_poll_us
        if config is not None:
            wanted = bool(config.get_from_extra_config("idle_progress_thread", wanted))
        if not wanted or not new_threads:
            return None
        return ProgressThreadCare(new_threads)

    #: "pull" (decode READs) or "push" (prefill WRITEs); part of the layout fingerprint.
    transfer_mode: str = "pull"
    #: Seconds spent describing and checking in the last ``register_kv_caches``.
    layout_check_seconds: float = 0.0
    validated_layers: list[ValidatedLayer]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        ratio = kernel_blocks_per_block(self)
        layers = describe_layers(kv_caches, self.kv_cache_config, ratio)
        self.validated_layers = check_layout(layers)
        self._refuse_strides_vllm_ignores()
        views = {
            item.layer.name: item for item in self.validated_layers if item.needs_physical_view
        }
        for_registration = {
            name: physical_view(cache, views[name]) if name in views else cache
            for name, cache in kv_caches.items()
        }
        for_registration = self._as_the_base_reads_them(kv_caches, for_registration)
        self.layout_check_seconds = time.perf_counter() - started
        forms = sorted({item.form.value for item in self.validated_layers})
        logger.info(
            "vllm-hybrid-nixl: %s (pid %d) validated %d KV-cache layers (r=%d, forms=%s, "
            "groups=%d) in %.2f ms",
            type(self).__name__,
            os.getpid(),
            len(self.validated_layers),
            ratio,
            ",".join(forms) or "-",
            len({item.layer.group_id for item in self.validated_layers}),
            self.layout_check_seconds * 1e3,
        )
        # Registering memory waits on NIXL's progress thread (thread_care.py).
        care = getattr(self, "_thread_care", None)
        if care is not None:
            care.before_registration()
        try:
            super().register_kv_caches(for_registration)  # type: ignore[misc]
        finally:
            if care is not None:
                care.after_registration()
        self._audit_registration()
        self._install_fingerprint()

    #: What the registration audit verified, and the seconds it took.
    audit_summary: AuditSummary | None = None
    audit_seconds: float = 0.0

    def _audit_registration(self) -> None:
        """Refuse the engine unless vLLM's descriptors are the bytes the check assigned
        (:mod:`~vllm_hybrid_nixl.connector.registration_audit`); say what was verified, and
        warn once on a vLLM newer than the newest tested release."""
        if getattr(self, "use_host_buffer", False):
            # vLLM registered host copies of the caches (kv_buffer_device cpu on a GPU); the
            # audit compares descriptors with the caches' own bytes, so it has nothing to say.
            logger.warning(
                "vllm-hybrid-nixl: KV transfers are staged through host buffers "
                "(kv_buffer_device=cpu on a GPU); the registration audit does not cover them, "
                "only the layout check ran"
            )
            return
        started = time.perf_counter()
        self.audit_summary = audit_registration(self, self.validated_layers)
        self.audit_seconds = time.perf_counter() - started
        installed = compat.installed_vllm()
        if installed is not None and compat.newer_than_tested(installed):
            logger.warning(
                "vllm-hybrid-nixl: %s==%s is newer than the newest tested release (%s); its "
                "NIXL registration was audited and matches the validated layout (%s). Report "
                "problems with this release to vllm-hybrid-nixl.",
                installed.distribution,
                installed.version,
                compat.NEWEST_TESTED,
                self.audit_summary.text(),
            )
        else:
            logger.info(
                "vllm-hybrid-nixl: registration audit passed in %.2f ms (%s)",
                self.audit_seconds * 1e3,
                self.audit_summary.text(),
            )

    def _refuse_strides_vllm_ignores(self) -> None:
        """Blocks further apart than a page (block-outermost packing of several layers) are
        handed to vLLM as they are; releases before 0.30 step NIXL descriptors by the page
        size, not the tensor's stride, and would move other layers' bytes."""
        if compat.stock_block_strides_from_tensor():
            return
        for item in self.validated_layers:
            if item.needs_physical_view or item.form not in (
                LayoutForm.LOGICAL,
                LayoutForm.PHYSICAL,
            ):
                continue
            if item.block_stride != item.physical_page_size:
                installed = compat.installed_vllm()
                raise HybridLayoutError(
                    f"KV cache of layer '{item.layer.name}' has blocks {item.block_stride} "
                    f"bytes apart but pages of {item.physical_page_size} bytes; the NIXL "
                    f"worker of vLLM {installed.version if installed else '?'} steps "
                    "descriptors by the page size, so it would transfer the wrong bytes. What "
                    "to change: vLLM 0.30 or newer (it steps by the tensor's stride), or a "
                    "KV-cache layout with one layer per allocation."
                )

    def _as_the_base_reads_them(
        self, kv_caches: dict[str, torch.Tensor], views: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Adapt block-major views to how this release's registration reads dim 0.

        0.24-0.25 take dim 0 of a non-blocks-first cache as K/V: every block-major layer is
        handed as ``[1, NB*r, PS/r]`` (one dense region of NB*r blocks instead of one region
        per block), and K/V-leading ``[2, NB*r, ...]`` caches go as they are (two regions).
        Later releases register one region per layer, so K/V-leading caches are refused.
        """
        block_major = {}
        kv_split = []
        for item in self.validated_layers:
            if item.form is LayoutForm.KV_SPLIT:
                kv_split.append(item)
            elif item.layer.spec_kind != MAMBA_KIND:
                block_major[item.layer.name] = item
        probe = next(iter(kv_split), None)
        if probe is not None:
            probe_shape = tuple(kv_caches[probe.layer.name].shape)
        elif block_major:
            name, item = next(iter(block_major.items()))
            probe_shape = (1, *physical_view(kv_caches[name], item).shape)
        else:
            return views
        splits = compat.stock_splits_first_dimension(self, probe_shape)
        if kv_split and not splits:
            layer = kv_split[0].layer
            installed = compat.installed_vllm()
            raise HybridLayoutError(
                f"KV cache of layer '{layer.name}' is K/V-leading {tuple(layer.shape)}; the "
                f"NIXL worker of {installed.distribution if installed else 'vLLM'}=="
                f"{installed.version if installed else '?'} registers one block-major region "
                "per layer, so its K and V halves would be transferred as the wrong blocks. "
                "What to change: use an attention backend with a blocks-first KV-cache layout "
                "(e.g. FLASH_ATTN, FLASHINFER) on this vLLM, or vLLM 0.24-0.25, whose NIXL "
                "worker registers K and V as separate regions."
            )
        if not splits:
            return views
        return {
            name: physical_view(kv_caches[name], block_major[name]).unsqueeze(0)
            if name in block_major
            else view
            for name, view in views.items()
        }

    # ---- layout fingerprint in the NIXL handshake ------------------------------------------
    layout_fingerprint: LayoutFingerprint

    def _install_fingerprint(self) -> None:
        """Replace vLLM's compatibility hash with our layout fingerprint (which embeds it)."""
        worker: Any = self
        self.layout_fingerprint = fingerprint_of(
            worker.vllm_config,
            worker.kv_cache_config,
            kernel_block_size=int(worker.block_size),
            attn_backend=str(worker.backend_name),
            kv_layout=str(worker.kv_cache_layout),
            transfer_mode=self.transfer_mode,
            vllm_compat_hash=str(worker.compat_hash),
        )
        worker.compat_hash = self.layout_fingerprint.encode()
        worker.xfer_handshake_metadata = dataclasses.replace(
            worker.xfer_handshake_metadata, compatibility_hash=worker.compat_hash
        )
        logger.info(
            "vllm-hybrid-nixl: layout fingerprint %s (block_size=%d, groups=%s)",
            self.layout_fingerprint.digest()[:16],
            self.layout_fingerprint.block_size,
            ",".join(group.kind for group in self.layout_fingerprint.groups),
        )

    def _nixl_handshake(
        self, host: str, port: int, remote_tp_size: int, expected_engine_id: str, *args, **kwargs
    ) -> Any:
        """Compare layouts with the peer before vLLM's own handshake adds it as a remote agent.

        vLLM then compares every remote rank's string with ours, exactly. A hybrid peer of
        another TP size sends a different string (its TP size and per-rank facts) that our
        comparison accepted; for that handshake vLLM is given the peer's verified string as
        the expected one, so it still confirms that every rank it reads sends exactly that
        layout. vLLM runs handshakes one at a time (one handshake thread), and reads
        ``compat_hash`` otherwise only when it builds its own metadata at registration."""
        worker: Any = self
        wire = self.verify_peer_layout(host, port, expected_engine_id, remote_tp_size)
        stated = self._fingerprint_tp.pop(expected_engine_id, 0)
        own = worker.compat_hash
        if wire is not None and wire != own:
            worker.compat_hash = wire
        try:
            result = super()._nixl_handshake(  # type: ignore[misc]
                host, port, remote_tp_size, expected_engine_id, *args, **kwargs
            )
        finally:
            worker.compat_hash = own
        # The peer's TP as its fingerprint states it (hybrids), else the one this handshake
        # ran with, which vLLM checked against the peer's block lengths (single-group
        # fingerprints carry none); recorded only once the handshake succeeded.
        tp = stated or remote_tp_size
        if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1:
            self.peer_tp_sizes[expected_engine_id] = tp
        return result

    def verify_peer_layout(
        self, host: str, port: int, engine_id: str, remote_tp_size: int | None = None
    ) -> str | None:
        """Raise (and log) when the peer's KV-cache layout or connector differs from ours;
        return the peer's string when it is ours and compatible but not equal to our own
        (a hybrid peer of another TP size), else None."""
        worker: Any = self
        # Pull mode: only the reader (the decode engine) handshakes, whatever its kv_role
        # (kv_both too). Push mode: both sides handshake (the decode to send its
        # registration), so there the kv_role says which side this is.
        is_decode = (
            self.transfer_mode == "pull" or worker.kv_transfer_config.kv_role == "kv_consumer"
        )
        local_role, remote_role = ("decode", "prefill") if is_decode else ("prefill", "decode")
        where = f"{engine_id} ({host}:{port})"
        wire = self._read_peer_compat_string(host, port, where)
        verdict = compare_with_peer(self.layout_fingerprint, wire, local_role)
        error: RuntimeError | None = None
        if verdict.stock_peer:
            allow = worker.kv_transfer_config.get_from_extra_config("allow_stock_peer", False)
            if not allow:
                error = StockPeerError(stock_peer_message(remote_role, where))
            else:
                # The user accepted the risk; vLLM's check cannot pass (the strings differ).
                worker.enforce_compat_hash = False
                logger.warning(
                    "vllm-hybrid-nixl: %s engine %s runs the stock NixlConnector; layouts are "
                    "NOT checked (allow_stock_peer is set)",
                    remote_role,
                    where,
                )
        elif not verdict.compatible:
            error = LayoutMismatchError(
                mismatch_message(verdict.differences, local_role, remote_role, where)
            )
        elif (
            verdict.remote is not None
            and verdict.remote.tensor_parallel_size
            and remote_tp_size is not None
            # the sender's scheduler sends max(TP, decode context parallel size)
            and verdict.remote.tensor_parallel_size > remote_tp_size
        ):
            error = LayoutMismatchError(
                f"vllm-hybrid-nixl refused KV transfer with {remote_role} engine {where}: its "
                f"layout fingerprint says tensor-parallel size "
                f"{verdict.remote.tensor_parallel_size}, but the request's transfer parameters "
                f"say {remote_tp_size} (at least its TP size); the request came from another "
                "engine than the one answering on that side channel. What to change: give "
                "every engine its own VLLM_NIXL_SIDE_CHANNEL_PORT and route each request to "
                "the engine that prefilled it."
            )
        if error is not None:
            logger.error("%s", error)
            raise error
        if verdict.remote is not None and verdict.remote.tensor_parallel_size:
            self._fingerprint_tp[engine_id] = int(verdict.remote.tensor_parallel_size)
        if verdict.stock_peer or wire == self.layout_fingerprint.encode():
            return None
        remote = verdict.remote
        logger.info(
            "vllm-hybrid-nixl: %s engine %s has TP %s, this engine TP %s; per-rank layouts "
            "correspond (%s)",
            remote_role,
            where,
            remote.tensor_parallel_size if remote else "?",
            self.layout_fingerprint.tensor_parallel_size,
            "; ".join(
                f"{g.kind}: {g.state or f'{g.page_bytes} B/page'}"
                for g in self.layout_fingerprint.groups
            ),
        )
        return wire

    @staticmethod
    def _read_peer_compat_string(host: str, port: int, where: str) -> str:
        with_pp_rank = compat.side_channel_wants_pp_rank()
        for attempt in range(1, PEER_PROBE_ATTEMPTS):
            try:
                return fetch_compat_string(
                    host, port, timeout_s=PEER_PROBE_TIMEOUT_S, with_pp_rank=with_pp_rank
                )
            except ProbeError as exc:
                logger.warning(
                    "vllm-hybrid-nixl: peer %s: %s; asking again (%d of %d)",
                    where,
                    exc,
                    attempt + 1,
                    PEER_PROBE_ATTEMPTS,
                )
        return fetch_compat_string(
            host, port, timeout_s=PEER_PROBE_TIMEOUT_S, with_pp_rank=with_pp_rank
        )


class HybridNixlPullWorker(
    DigestGuardMixin, LeaseReaderMixin, HybridRegistrationMixin, _NIXL.pull_worker
):
    """Pull-mode (READ) NIXL worker with the HMA-aware registration, the lease guard and
    the end-to-end KV digest."""

    def start_load_kv(self, metadata: Any) -> Any:
        reads = list(getattr(metadata, "reqs_to_recv", None) or ()) if kv_timeline.enabled() else []
        started = super().start_load_kv(metadata)
        kv_timeline.record_all("read_posted", reads)
        return started

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        kv_timeline.record_all("read_reported", results.finished_recving, results.failed_recving)
        return results


class HybridNixlPushWorker(LeaseReaderMixin, HybridRegistrationMixin, _NIXL.push_worker):
    """Push-mode (WRITE) NIXL worker with the HMA-aware registration and the lease guard:
    a decode request whose pin was refused is failed without registering, and a prefill
    whose lease ended no longer writes that request's blocks."""

    transfer_mode = "push"

    def get_transfer_results(self) -> Any:
        expired = set(self._lease_expired)
        results = super().get_transfer_results()
        if expired:
            compat.evict_expired_pushes(self, expired)
        return results
