"""``vllm_hybrid_nixl_kv_digest_mismatches_total`` on a decode engine's /metrics: vLLM's NIXL
transfer stats and Prometheus metrics with one more counter.

A mismatch is recorded in the worker's transfer stats (which vLLM carries from the worker
through the engine core to the API server) under :data:`MISMATCH_KEY`, and also as a failed
transfer (``vllm:nixl_num_failed_transfers``). Built only where vLLM has the NIXL stats
classes of 0.32+ (:func:`stats_classes`); elsewhere the connector keeps vLLM's own.
"""

from __future__ import annotations

import importlib
from typing import Any

MISMATCH_KEY = "num_kv_digest_mismatches"
METRIC_NAME = "vllm_hybrid_nixl_kv_digest_mismatches"


def _vllm_stats() -> tuple[type, type, Any] | None:
    try:
        stats = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats")
        utils = importlib.import_module("vllm.v1.metrics.utils")
    except ImportError:
        return None
    base_stats = getattr(stats, "NixlKVConnectorStats", None)
    base_prom = getattr(stats, "NixlPromMetrics", None)
    per_engine = getattr(utils, "create_metric_per_engine", None)
    if base_stats is None or base_prom is None or per_engine is None:
        return None
    return base_stats, base_prom, per_engine


def _build() -> tuple[type, type] | None:
    found = _vllm_stats()
    if found is None:
        return None
    base_stats, base_prom, per_engine = found

    class HybridNixlStats(base_stats):  # type: ignore[misc, valid-type]
        """vLLM's NIXL transfer stats, plus KV digest mismatches."""

        def reset(self) -> None:
            super().reset()
            self.data[MISMATCH_KEY] = []

        def record_digest_mismatch(self) -> None:
            self.data.setdefault(MISMATCH_KEY, []).append(1)

        def is_empty(self) -> bool:
            return super().is_empty() and not self.data.get(MISMATCH_KEY)

        def aggregate(self, other: Any) -> Any:
            for key in getattr(other, "data", {}):
                self.data.setdefault(key, [])
            return super().aggregate(other)

    class HybridNixlPromMetrics(base_prom):  # type: ignore[misc, valid-type]
        """vLLM's NIXL metrics, plus ``vllm_hybrid_nixl_kv_digest_mismatches_total``."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter = self._counter_cls(
                name=METRIC_NAME,
                documentation="KV reads whose bytes differed from the prefill engine's "
                "(vllm-hybrid-nixl's end-to-end KV digest); each is a failed KV load.",
                labelnames=labelnames,
            )
            self.counter_kv_digest_mismatches = per_engine(counter, self.per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            super().observe(transfer_stats_data, engine_idx)
            for value in transfer_stats_data.get(MISMATCH_KEY, ()):
                self.counter_kv_digest_mismatches[engine_idx].inc(value)

    return HybridNixlStats, HybridNixlPromMetrics


_CLASSES: tuple[type, type] | None | bool = False


def stats_classes() -> tuple[type, type] | None:
    """(stats class, Prometheus metrics class), or None on releases without them."""
    global _CLASSES
    if _CLASSES is False:
        _CLASSES = _build()
    return _CLASSES  # type: ignore[return-value]
