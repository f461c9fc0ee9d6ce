"""A decode request's lease pin is asked when the request arrives, not at its first
schedule(): vLLM's real connector (scheduler role, built from the tiny hybrid's real
VllmConfig) and vLLM's own Request, against a real lease service on 127.0.0.1 (ZeroMQ, the
real lease table). Without it, the first schedule() asked, skipped the request and read the
answer a step later: one step per P/D request, ~30 ms at 32 concurrent here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

install_cpu_version_alias()

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_hybrid_nixl.connector import compat  # noqa: E402
from vllm_hybrid_nixl.connector.connectors import HybridNixlConnector  # noqa: E402
from vllm_hybrid_nixl.connector.lease import prompt_digest  # noqa: E402
from vllm_hybrid_nixl.preflight.dry_run import kv_cache_setup  # noqa: E402
from vllm_hybrid_nixl.protocol.lease_table import LeaseState, LeaseTable  # noqa: E402
from vllm_hybrid_nixl.protocol.lease_wire import PARAMS_KEY, LeaseServer  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not compat.transfer_results_api(), reason="releases before 0.32 pin inside the step"
    ),
]

PROMPT = list(range(100, 300))  # 200 tokens: 3 blocks of 64 and a partial one


@dataclass
class DecodeSide:
    connector: Any
    table: LeaseTable  # the prefill engine's lease table, behind ``server``
    server: LeaseServer


@pytest.fixture(scope="module")
def decode_side(tiny_hybrid_model: Path) -> Iterator[DecodeSide]:
    engine_args = EngineArgs(
        model=str(tiny_hybrid_model),
        enforce_eager=True,
        max_model_len=512,
        block_size=64,
        load_format="dummy",
        kv_transfer_config={
            "kv_connector": "HybridNixlConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
        },
    )
    with kv_cache_setup(engine_args) as setup:
        connector = HybridNixlConnector(
            setup.vllm_config, KVConnectorRole.SCHEDULER, setup.kv_cache_config
        )
        table = LeaseTable(lease_s=30.0, pin_s=30.0, forget_after_s=120)
        yield DecodeSide(connector, table, LeaseServer(table, "127.0.0.1"))


def decode_request(side: DecodeSide, req_id: str, remote_req: str) -> Request:
    """A decode leg as vLLM's API server hands it to the engine core: the prefill's
    ``kv_transfer_params`` (with our lease value) on the sampling parameters."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": remote_req,
        "remote_engine_id": "prefill-engine",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[0, 1, 2, 3], [0, 1, 2, 3]],
        "tp_size": 1,
        PARAMS_KEY: {
            **side.server.address.to_params(),
            "lease_s": side.table.lease_s,
            "pin_s": side.table.pin_s,
            "prompt_tokens": len(PROMPT),
            "prompt_sha256": prompt_digest(PROMPT),
        },
    }
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(req_id, list(PROMPT), sampling, None)


def wait_for_state(table: LeaseTable, req_id: str, state: LeaseState) -> None:
    deadline = time.monotonic() + 10.0
    while table.status(req_id).state is not state:
        if time.monotonic() > deadline:
            raise AssertionError(f"{req_id}: {table.status(req_id)}, expected {state}")
        time.sleep(0.005)


def test_the_pin_is_asked_on_arrival_and_the_first_schedule_loads(decode_side) -> None:
    side = decode_side
    side.table.hold("prefill-1")
    request = decode_request(side, "decode-1", "prefill-1")
    side.connector.on_new_request(request)
    # pinned with no schedule() yet: the question left as the request arrived
    wait_for_state(side.table, "prefill-1", LeaseState.PINNED)
    tokens, load_async = side.connector.get_num_new_matched_tokens(request, 0)
    assert tokens is not None and tokens > 0 and load_async  # loads at its first schedule()


def test_a_request_whose_lease_is_gone_is_refused_by_name_at_its_first_schedule(
    decode_side,
) -> None:
    """The early pin changes when the question is asked, not what a refusal does."""
    side = decode_side
    side.table.hold("prefill-2")
    side.table.settle({"prefill-2"})  # read by another decode engine and freed
    request = decode_request(side, "decode-2", "prefill-2")
    side.connector.on_new_request(request)
    deadline = time.monotonic() + 10.0
    answer = side.connector.get_num_new_matched_tokens(request, 0)
    while answer[0] is None and time.monotonic() < deadline:  # pin answer still on its way
        answer = side.connector.get_num_new_matched_tokens(request, 0)
    assert answer[0] is not None
    connector = side.connector
    refusal = connector._refused_reads.get("decode-2") or connector._lease_pending.get("decode-2")
    assert refusal and "released" in refusal and "prefill-2" in refusal, refusal


def test_a_prompt_that_is_not_the_prefilled_one_is_never_pinned(decode_side) -> None:
    """A decode leg carrying another request's parameters is refused before any pin, so it
    cannot take the blocks from the decode leg they belong to."""
    side = decode_side
    side.table.hold("prefill-3")
    request = decode_request(side, "decode-3", "prefill-3")
    request.prompt_token_ids[5] += 1  # another prompt under the same parameters
    side.connector.on_new_request(request)
    time.sleep(0.2)
    assert side.table.status("prefill-3").state is LeaseState.HELD
    assert "decode-3" not in side.connector._pins
