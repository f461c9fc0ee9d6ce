"""``vllm_hybrid_nixl_kv_digest_mismatches_total`` on a decode engine's /metrics: vLLM's NIXL
transfer stats and Prometheus metrics with one more counter.

A mismatch is recorded in the worker's transfer stats (which vLLM pickles from the worker
through the engine core to the API server, so the classes live at module level) under
:data:`MISMATCH_KEY`, and also as a failed transfer (``vllm:nixl_num_failed_transfers``).
Built only where vLLM has the NIXL stats classes of 0.32+ (:func:`stats_classes`); elsewhere
the connector keeps vLLM's own.
"""

from __future__ import annotations

from typing import Any

MISMATCH_KEY = "num_kv_digest_mismatches"
METRIC_NAME = "vllm_hybrid_nixl_kv_digest_mismatches"

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
        NixlKVConnectorStats,
        NixlPromMetrics,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine
except ImportError:  # releases before 0.32 keep their stats elsewhere: vLLM's own are used
    NixlKVConnectorStats = NixlPromMetrics = create_metric_per_engine = None  # type: ignore


if NixlKVConnectorStats is not None and NixlPromMetrics is not None:

    class HybridNixlStats(NixlKVConnectorStats):  # type: ignore[misc, valid-type]
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

    class HybridNixlPromMetrics(NixlPromMetrics):  # type: ignore[misc, valid-type]
        """vLLM's NIXL metrics, plus ``vllm_hybrid_nixl_kv_digest_mismatches_total``."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter = self._counter_cls(
                name=METRIC_NAME,
                documentation="KV reads whose bytes differed from the prefill engine's "
                "(vllm-hybrid-nixl's end-to-end KV digest); each is a failed KV load.",
                labelnames=labelnames,
            )
            self.counter_kv_digest_mismatches = create_metric_per_engine(
                counter, self.per_engine_labelvalues
            )

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            super().observe(transfer_stats_data, engine_idx)
            for value in transfer_stats_data.get(MISMATCH_KEY, ()):
                self.counter_kv_digest_mismatches[engine_idx].inc(value)

    _CLASSES: tuple[type, type] | None = (HybridNixlStats, HybridNixlPromMetrics)
else:
    _CLASSES = None


def stats_classes() -> tuple[type, type] | None:
    """(stats class, Prometheus metrics class), or None on releases without them or without
    the KV digest (vLLM's own classes are used there)."""
    from vllm_hybrid_nixl.connector import compat

    return _CLASSES if compat.digest_hooks_available() else None
