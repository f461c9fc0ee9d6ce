"""A prefill worker digests a finished request's blocks when the step's connector metadata is
bound, before the step's forward, not in ``start_load_kv``: vLLM 0.32 calls that after
launching the forward, which on CPU means after the whole forward ran, and a decode engine
waiting for the digests waited that long (measured in ``bench/goodput.py``'s P/D runs: up to
0.9 s of a 1-4k-token prefill; decode-side queue 0.24-0.36 s per request, 0.05 s after).

A real pull worker (real vLLM config and caches for the tiny hybrid, digest service on), the
real connector class bound to it, vLLM's own NIXL metadata class."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import worker_harness as harness
from tests.integration.test_worker_registration import started_worker
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.connectors import HybridNixlConnector
from vllm_hybrid_nixl.connector.digest_guard import SOURCES_ATTRIBUTE

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not compat.digest_hooks_available(), reason="no KV digest on this vLLM release"
    ),
]


@pytest.fixture(scope="module")
def setup(tiny_hybrid_model) -> Iterator[harness.ModelSetup]:
    with harness.model_setup(str(tiny_hybrid_model)) as model_setup:
        yield model_setup


def metadata_naming(request_id: str, groups: int) -> object:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    metadata = NixlConnectorMetadata()
    setattr(metadata, SOURCES_ATTRIBUTE, {request_id: [[1, 2, 3]] * groups})
    return metadata


def test_binding_the_metadata_digests_before_the_forward_and_only_once(
    setup: harness.ModelSetup,
) -> None:
    groups = len(setup.kv_cache_config.kv_cache_groups)
    with started_worker(setup, 1) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=3)
        worker.register_kv_caches(caches.views)
        connector = HybridNixlConnector.__new__(HybridNixlConnector)  # the worker role's state
        connector.connector_worker = worker
        metadata = metadata_naming("finished-prefill", groups)
        assert worker._digest_table.get("finished-prefill") is None
        connector.bind_connector_metadata(metadata)
        digests = worker._digest_table.get("finished-prefill")
        assert digests is not None and len(digests) == groups  # served from now on
        assert getattr(metadata, SOURCES_ATTRIBUTE) is None  # taken off: not digested twice
        caches.views[next(iter(caches.views))].view(-1)[:64].add_(1)  # the next forward writes
        worker.start_load_kv(metadata)
        assert worker._digest_table.get("finished-prefill") is digests


def test_a_worker_bound_without_the_connector_still_digests_in_start_load_kv(
    setup: harness.ModelSetup,
) -> None:
    """A release or path that never binds through our connector loses nothing."""
    groups = len(setup.kv_cache_config.kv_cache_groups)
    with started_worker(setup, 1) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=4)
        worker.register_kv_caches(caches.views)
        metadata = metadata_naming("late-bound", groups)
        worker.start_load_kv(metadata)
        assert worker._digest_table.get("late-bound") is not None
