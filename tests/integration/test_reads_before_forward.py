"""A worker on vLLM's CPU platform starts a step's KV reads when the step's metadata is
bound, before the forward, and vLLM's own later ``start_load_kv`` call starts nothing again.

vLLM starts asynchronous loads after launching the step's forward; on CPU the forward is
synchronous, so a read posted there waited out the whole forward and was seen done a step
later. The test runs vLLM's own connector context (``_get_kv_connector_output``, the code the
model runner wraps its forward in) around a stand-in for the forward, with the real connector
class, a real pull worker on real caches and vLLM's NIXL metadata (one per step, with no
reads: a read needs a peer); a recorder around the worker's ``start_load_kv`` notes which
step's metadata it was given and calls through."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.harness import worker_harness as harness
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.connectors import HybridNixlConnector
from vllm_hybrid_nixl.connector.worker import reads_before_forward

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tiny_hybrid_model) -> Iterator[harness.ModelSetup]:
    with harness.model_setup(str(tiny_hybrid_model)) as model_setup:
        yield model_setup


@contextmanager
def installed_connector(connector: Any) -> Iterator[None]:
    """Make ``connector`` the process's KV-transfer group, as vLLM's worker start does."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    before = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = before


def run_steps(setup: harness.ModelSetup, early: bool, sync_loads: list[bool]) -> list[str]:
    """Steps through vLLM's connector context, one per ``sync_loads`` entry (whether the
    step has loads its forward needs); the events in the order they happened, each start
    named by the step whose metadata it was given."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.forward_context import set_forward_context
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    events: list[str] = []
    with set_current_vllm_config(setup.vllm_config):
        connector = HybridNixlConnector(
            setup.vllm_config, KVConnectorRole.WORKER, setup.kv_cache_config
        )
    try:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=5)
        connector.register_kv_caches(caches.views)
        worker = connector.connector_worker
        worker.reads_before_forward = early
        started = worker.start_load_kv
        step_of: dict[int, int] = {}

        def recorded_start(metadata: Any) -> Any:
            events.append(f"start {step_of.get(id(metadata), '?')}")
            return started(metadata)

        worker.start_load_kv = recorded_start
        for step, sync in enumerate(sync_loads):
            scheduler_output = SchedulerOutput.make_empty()
            scheduler_output.kv_connector_metadata = NixlConnectorMetadata()
            if hasattr(scheduler_output, "has_sync_kv_loads"):
                scheduler_output.has_sync_kv_loads = sync
            step_of[id(scheduler_output.kv_connector_metadata)] = step
            with (
                installed_connector(connector),
                set_forward_context(None, setup.vllm_config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output),
            ):
                events.append(f"forward {step}")
        return events
    finally:
        connector.shutdown()


def test_reads_start_before_the_forward_once_a_step(setup: harness.ModelSetup) -> None:
    events = run_steps(setup, early=True, sync_loads=[False, False, True, False])
    assert events == [
        "start 0", "forward 0", "start 1", "forward 1",
        "start 2", "forward 2", "start 3", "forward 3",
    ]  # fmt: skip


def test_switched_off_the_reads_start_where_vllm_starts_them(setup: harness.ModelSetup) -> None:
    events = run_steps(setup, early=False, sync_loads=[False, True])
    assert events.count("start 0") == 1 and events.count("start 1") == 1
    if compat.on_cpu_platform():  # vLLM: asynchronous loads after the forward's launch
        assert events[:2] == ["forward 0", "start 0"]


def test_the_default_follows_the_platform_and_bad_values_name_the_key(
    setup: harness.ModelSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check stands in a GPU platform for ``compat.on_cpu_platform`` (no GPU
    here): an early read is refused there by name."""
    config = setup.vllm_config.kv_transfer_config
    assert reads_before_forward(None) is compat.on_cpu_platform()
    extra = config.kv_connector_extra_config
    before = dict(extra)
    try:
        extra.pop("reads_before_forward", None)
        assert reads_before_forward(config) is compat.on_cpu_platform()
        extra["reads_before_forward"] = False
        assert reads_before_forward(config) is False
        extra["reads_before_forward"] = "yes"
        with pytest.raises(ValueError, match="reads_before_forward is 'yes'; expected true"):
            reads_before_forward(config)
        extra["reads_before_forward"] = True
        monkeypatch.setattr(compat, "on_cpu_platform", lambda: False)
        with pytest.raises(ValueError, match="does not run on vLLM's CPU platform"):
            reads_before_forward(config)
        extra.pop("reads_before_forward")
        assert reads_before_forward(config) is False
    finally:
        extra.clear()
        extra.update(before)
