"""The registration audit over real vLLM NIXL workers and real caches (every matrix release).

After vLLM's own ``register_kv_caches``, our worker asks vLLM's descriptor computation which
(address, length) ranges it will move for sampled logical blocks of every group and compares
them with the bytes the layout check assigned. The negative controls break each side: vLLM
handed the raw ``[NB, PS]`` tensors with r = 2 (our views off: vLLM 0.30+ register them with
the wrong block stride), and a descriptor moved by one page after registration. The kernel
block size r > 1 is the harness's stand-in for a GPU attention kernel (see
``harness.kernel_block_size``); everything else is vLLM's and NIXL's own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from tests.harness import worker_harness as harness
from tests.harness.releases import stock_is_strict
from tests.integration.test_worker_registration import started_worker
from vllm_hybrid_nixl.connector.registration_audit import RegistrationAuditError, sample_blocks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tiny_hybrid_model) -> Iterator[harness.ModelSetup]:
    with harness.model_setup(str(tiny_hybrid_model)) as model_setup:
        yield model_setup


class Captured(logging.Handler):
    """Records of one logger, whatever vLLM did to propagation."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def worker_log() -> Iterator[Captured]:
    handler = Captured()
    logger = logging.getLogger("vllm.hybrid_nixl.worker")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize(("form", "ratio"), [("logical", 1), ("physical", 2), ("flat", 4)])
def test_every_group_and_sampled_block_is_verified(
    setup: harness.ModelSetup, form: str, ratio: int, worker_log: Captured
) -> None:
    with started_worker(setup, ratio) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, form, ratio, seed=2)
        worker.register_kv_caches(caches.views)
        summary = worker.audit_summary
        nb = setup.kv_cache_config.num_blocks
        assert summary.groups == len(setup.kv_cache_config.kv_cache_groups) == 2
        assert summary.blocks == sample_blocks(nb) and {0, nb - 1} <= set(summary.blocks)
        # every layer's r kernel pages of each sampled block, in each group
        regions = len(set(caches.layer_regions.values()))
        assert summary.descriptors == len(summary.blocks) * 2 * regions * ratio
        assert any("registration audit passed" in r.getMessage() for r in worker_log.records)


def test_raw_caches_with_r_2_are_refused_where_vllm_registers_them_wrong(
    setup: harness.ModelSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our views switched off: vLLM gets the dense [NB, PS] tensors with r = 2. vLLM 0.30+
    take the block stride from the tensor (PS, not PS/r): the audit refuses, naming the
    layer, group and block. 0.26-0.29 place the blocks by page size (right bytes: passes);
    0.24-0.25 refuse the tensors themselves."""
    from vllm_hybrid_nixl.connector import compat
    from vllm_hybrid_nixl.connector.worker import HybridRegistrationMixin

    monkeypatch.setattr(
        HybridRegistrationMixin, "_as_the_base_reads_them", lambda self, caches, views: caches
    )
    with started_worker(setup, 2) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 2, seed=3)
        if stock_is_strict():
            with pytest.raises(AssertionError):
                worker.register_kv_caches(caches.views)
        elif compat.stock_block_strides_from_tensor():
            with pytest.raises(RegistrationAuditError) as refused:
                worker.register_kv_caches(caches.views)
            text = str(refused.value)
            assert "for logical block 0 of KV-cache group 0" in text
            assert "layer 'model.layers." in text and "What to change" in text
        else:
            worker.register_kv_caches(caches.views)
            assert worker.audit_summary.descriptors > 0


def test_a_descriptor_moved_by_one_page_is_refused_by_name(setup: harness.ModelSetup) -> None:
    with started_worker(setup, 1) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=4)
        worker.register_kv_caches(caches.views)
        table = np.array(worker.src_blocks_data, dtype=np.uint64)
        page = int(table[0, 1])
        table[0, 0] += page  # the first descriptor (block 0 of the first region) moves on
        worker.src_blocks_data = (
            table
            if isinstance(worker.src_blocks_data, np.ndarray)
            else [tuple(int(v) for v in row) for row in table]
        )
        with pytest.raises(RegistrationAuditError) as refused:
            worker._audit_registration()
        text = str(refused.value)
        assert "for logical block 0 of KV-cache group" in text
        assert f"{page} bytes" in text and "layer 'model.layers." in text


def test_a_release_newer_than_tested_runs_when_the_audit_passes(
    setup: harness.ModelSetup, monkeypatch: pytest.MonkeyPatch, worker_log: Captured
) -> None:
    """The installed release seen through a raised version (what `pip install -U vllm` gives
    a user the day after our newest tested release): registered, with one warning that names
    the newest tested release and what was verified."""
    from packaging.version import Version

    from vllm_hybrid_nixl.connector import compat

    real = compat.installed_vllm()
    raised = compat.InstalledVllm(real.distribution, Version("9.1.0"))
    monkeypatch.setattr(compat, "installed_vllm", lambda: raised)
    with started_worker(setup, 2) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "physical", 2, seed=5)
        worker.register_kv_caches(caches.views)
        warnings = [r.getMessage() for r in worker_log.records if r.levelno == logging.WARNING]
        newer = [w for w in warnings if "newer than the newest tested release" in w]
        assert len(newer) == 1, warnings
        assert f"({compat.NEWEST_TESTED})" in newer[0] and "==9.1.0" in newer[0]
        assert "NIXL descriptors of 2 KV-cache groups" in newer[0]


def test_a_release_whose_descriptor_facts_are_missing_is_refused_by_name(
    setup: harness.ModelSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if a newer vLLM had renamed the descriptor computation the audit reads."""
    from vllm_hybrid_nixl.connector import compat

    monkeypatch.delattr(compat.nixl_classes().base_worker, "_compute_desc_ids")
    with started_worker(setup, 1) as worker:
        caches = harness.allocate_caches(setup.kv_cache_config, "logical", 1, seed=6)
        with pytest.raises(RegistrationAuditError, match="has no '_compute_desc_ids'"):
            worker.register_kv_caches(caches.views)


@pytest.fixture(scope="module")
def padded_setup(tmp_path_factory) -> Iterator[harness.ModelSetup]:
    """A Gemma-3-like model of 5 layers (3 sliding, 2 full): vLLM gives its KV-cache groups
    equal layer counts, so one sliding group has a layer slot it does not fill."""
    from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("gemma3-5"), TinyModelSpec("gemma3", layers=5))
    with harness.model_setup(str(model)) as model_setup:
        yield model_setup


def test_a_group_padded_to_the_others_layer_count_is_audited_and_registers(
    padded_setup: harness.ModelSetup,
) -> None:
    """Gemma 3's real layer counts (26 = 22 sliding + 4 full) leave such gaps too. vLLM's
    descriptors for a block of the short group also cover the slot it has no layer in; the
    audit accepts bytes of that block in another layer, and still needs every byte of the
    group's own layers."""
    from vllm_hybrid_nixl.connector import compat

    groups = padded_setup.kv_cache_config.kv_cache_groups
    sizes = sorted(len(group.layer_names) for group in groups)
    assert len(groups) == 3 and sizes[0] < sizes[-1], sizes
    with started_worker(padded_setup, 1) as worker:
        caches = harness.allocate_caches(padded_setup.kv_cache_config, "logical", 1, seed=7)
        worker.register_kv_caches(caches.views)
        assert worker.audit_summary.groups == 3
        # What vLLM reads for block 1 of each group, against that group's own layers' bytes.
        query = compat.block_descriptor_query(worker)
        layers_of = {g: len(group.layer_names) for g, group in enumerate(groups)}
        read = {g: len(query([[1] if i == g else [] for i in range(3)])) for g in layers_of}
        assert all(read[g] >= layers_of[g] for g in layers_of), (read, layers_of)
