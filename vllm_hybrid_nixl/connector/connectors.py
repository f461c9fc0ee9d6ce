"""``HybridNixlConnector`` (pull) and ``HybridNixlPushConnector``: vLLM's NIXL
connectors whose workers run the HMA-aware ``register_kv_caches``.

Both run the KV lease guard (:mod:`vllm_hybrid_nixl.connector.lease`) on the scheduler
side; otherwise scheduler behaviour is vLLM's own.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.digest_metrics import stats_classes
from vllm_hybrid_nixl.connector.lease import LeaseHolderMixin
from vllm_hybrid_nixl.connector.mamba_guard import refuse_unservable_mamba
from vllm_hybrid_nixl.connector.side_channel import refuse_busy_side_channel
from vllm_hybrid_nixl.connector.worker import HybridNixlPullWorker, HybridNixlPushWorker

_NIXL = compat.nixl_classes()


class _HybridWorkerMixin:
    """Builds the hybrid worker instead of the stock one in the worker role."""

    _hybrid_worker_class: type

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        refuse_unservable_mamba(vllm_config, kv_cache_config)
        if role != _NIXL.connector_role.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
            refuse_busy_side_channel(getattr(self, "connector_scheduler", None))
            return
        # Skip the stock subclass constructor, which would build (and register a
        # NIXL agent for) the stock worker; the shared base does the config checks.
        _NIXL.base_connector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler = None
        self.connector_worker = self._hybrid_worker_class(
            vllm_config, self.engine_id, kv_cache_config
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Binds the step's metadata, and has a prefill worker digest the blocks it names
        now, before the step's forward (see ``DigestGuardMixin.digest_sources``). Where
        ``reads_before_forward`` holds, the step's reads start here too."""
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]
        worker = self.connector_worker
        digest_sources = getattr(worker, "digest_sources", None)
        if digest_sources is not None:
            digest_sources(connector_metadata)
        if worker is not None and getattr(worker, "reads_before_forward", False):
            self._loads_started_for = connector_metadata
            worker.start_load_kv(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """vLLM's call, after the forward for asynchronous loads; a no-op for metadata whose
        loads started when it was bound."""
        started = getattr(self, "_loads_started_for", None)
        if started is not None and started is self._connector_metadata:
            self._loads_started_for = None
            return
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]


class HybridNixlConnector(LeaseHolderMixin, _HybridWorkerMixin, _NIXL.pull_connector):
    """Pull-mode (READ) NIXL connector for hybrid models; the default."""

    _hybrid_worker_class = HybridNixlPullWorker

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        classes = stats_classes()
        if classes is None:
            return super().build_kv_connector_stats(data)
        return classes[0](data=data) if data is not None else classes[0]()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        classes = stats_classes()
        if classes is None:
            return super().build_prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        return classes[1](vllm_config, metric_types, labelnames, per_engine_labelvalues)


class HybridNixlPushConnector(LeaseHolderMixin, _HybridWorkerMixin, _NIXL.push_connector):
    """Push-mode (WRITE) NIXL connector for hybrid models, with the KV lease guard (its
    decode pins the prefill's lease before registering, so a late leg fails at once). Not
    verified by the KV digest: push workers check none."""

    _lease_digests = False

    _hybrid_worker_class = HybridNixlPushWorker
