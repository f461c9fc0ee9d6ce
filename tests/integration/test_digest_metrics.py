"""The digest-mismatch counter rides vLLM's own NIXL stats path: the stats class survives the
pickling vLLM does between the worker, the engine core and the API server, aggregates with
stats of other workers, and its Prometheus metrics class counts mismatches as
``vllm_hybrid_nixl_kv_digest_mismatches_total`` (real vLLM classes, a private registry)."""

from __future__ import annotations

import pickle

import prometheus_client
import pytest

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.connectors import HybridNixlConnector
from vllm_hybrid_nixl.connector.digest_metrics import MISMATCH_KEY, stats_classes

pytestmark = pytest.mark.integration

needs_stats = pytest.mark.skipif(
    stats_classes() is None, reason="vLLM before 0.32 has no NIXL stats classes to extend"
)


@needs_stats
def test_stats_with_a_mismatch_survive_pickling_and_aggregate() -> None:
    stats = HybridNixlConnector.build_kv_connector_stats()
    assert compat.record_digest_mismatch(stats)
    assert not stats.is_empty()
    copy = pickle.loads(pickle.dumps(stats))
    assert copy.data[MISMATCH_KEY] == [1] and copy.data["num_failed_transfers"] == [1]
    rebuilt = HybridNixlConnector.build_kv_connector_stats(data=copy.data)
    other = HybridNixlConnector.build_kv_connector_stats()
    other.aggregate(rebuilt)
    assert other.data[MISMATCH_KEY] == [1]


@needs_stats
def test_the_prometheus_metrics_count_mismatches() -> None:
    from vllm.config import VllmConfig

    registry = prometheus_client.CollectorRegistry()

    class Counter(prometheus_client.Counter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    class Gauge(prometheus_client.Gauge):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    class Histogram(prometheus_client.Histogram):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    types = {
        prometheus_client.Counter: Counter,
        prometheus_client.Gauge: Gauge,
        prometheus_client.Histogram: Histogram,
    }
    metrics = HybridNixlConnector.build_prom_metrics(
        VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    stats = HybridNixlConnector.build_kv_connector_stats()
    stats.record_digest_mismatch()
    stats.record_digest_mismatch()
    metrics.observe(stats.data, 0)
    value = registry.get_sample_value(
        "vllm_hybrid_nixl_kv_digest_mismatches_total", {"model_name": "m", "engine": "0"}
    )
    assert value == 2
