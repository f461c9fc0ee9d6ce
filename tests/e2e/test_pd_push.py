"""``HybridNixlPushConnector`` (push mode) in real ``vllm serve`` processes, loaded the two
other ways a user can: the prefill engine with ``VLLM_PLUGINS=hybrid_nixl`` (plugin filter
naming us) and the decode engine with ``kv_connector_module_path`` while ``VLLM_PLUGINS``
filters our plugin out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.pd_fixture import WORKER_LINE, PdPair, start_pair

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair(tiny_hybrid_model, tmp_path_factory) -> Iterator[PdPair]:
    yield from start_pair(
        tiny_hybrid_model,
        tmp_path_factory.mktemp("pd-push-logs"),
        prefill={"connector": "HybridNixlPushConnector", "env": {"VLLM_PLUGINS": "hybrid_nixl"}},
        decode={
            "connector": "HybridNixlPushConnector",
            "connector_module_path": "vllm_hybrid_nixl.connector.connectors",
            "env": {"VLLM_PLUGINS": "some_other_plugin"},
        },
    )


def test_both_sides_run_our_push_worker(pair: PdPair) -> None:
    for engine in (pair.prefill, pair.decode):
        classes = [m["cls"] for m in WORKER_LINE.finditer(engine.log_text())]
        assert classes == ["HybridNixlPushWorker"], engine.log_path


def test_push_worker_is_ready_to_write(pair: PdPair) -> None:
    """Registration went through vLLM's push path: the writer thread started afterwards.

    A push-mode request needs the router to start the decode leg while the prefill leg
    runs (prefill answers only once its KV is pushed or its lease expires); that flow
    belongs to the router, so the request path is exercised there.
    """
    for engine in (pair.prefill, pair.decode):
        text = engine.log_text()
        registered = text.index("vllm-hybrid-nixl: HybridNixlPushWorker")
        assert text.index("nixl-push-writer thread started", registered) > registered
