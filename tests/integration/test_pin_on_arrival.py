"""A decode request's lease pin is asked when the request arrives, not at its first
schedule(): vLLM's real connector (scheduler role, built from the tiny hybrid's real
VllmConfig) and vLLM's own Request, against a real lease service on 127.0.0.1 (ZeroMQ, the
real lease table). Without it, the first schedule() asked, skipped the request and read the
answer a step later: one step per P/D request, ~30 ms at 32 concurrent here. The question
leaves from the scheduler's own thread (:mod:`vllm_hybrid_nixl.connector.direct_pin`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from vllm_hybrid_nixl.connector.launcher import install_cpu_version_alias

install_cpu_version_alias()

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from tests.unit.test_lease_wire_robustness import silent_lease_service  # noqa: E402
from vllm_hybrid_nixl.connector import compat, lease  # noqa: E402
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


def decode_connector(model: Path, extra: dict[str, Any] | None = None) -> Iterator[Any]:
    """The decode engine's real connector (scheduler role), ``extra`` as its
    ``kv_connector_extra_config``."""
    engine_args = EngineArgs(
        model=str(model),
        enforce_eager=True,
        max_model_len=512,
        block_size=64,
        load_format="dummy",
        kv_transfer_config={
            "kv_connector": "HybridNixlConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": extra or {},
        },
    )
    with kv_cache_setup(engine_args) as setup:
        yield HybridNixlConnector(
            setup.vllm_config, KVConnectorRole.SCHEDULER, setup.kv_cache_config
        )


@pytest.fixture(scope="module")
def decode_side(tiny_hybrid_model: Path) -> Iterator[DecodeSide]:
    """With ``direct_pins`` (the scheduler's thread asks and reads); the default, a
    background thread, has its own test below."""
    for connector in decode_connector(tiny_hybrid_model, {"direct_pins": True}):
        table = LeaseTable(lease_s=30.0, pin_s=30.0, forget_after_s=120)
        yield DecodeSide(connector, table, LeaseServer(table, "127.0.0.1"))


def decode_request(
    side: DecodeSide, req_id: str, remote_req: str, lease_port: int | None = None
) -> Request:
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
            **({"port": lease_port} if lease_port else {}),
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


def wait_for_answer(connector: Any, req_id: str) -> None:
    """Until the lease service's answer to ``req_id``'s pin is back, unread: on the socket of
    the scheduler's thread (the next ``schedule()`` reads it) or, for a pin asked in the
    background, in its future."""
    future = connector._pins[req_id]
    direct = connector._direct_pins
    sockets = [
        direct._sockets[a.address.endpoint] for a in direct._asked.values() if a.future is future
    ]
    if sockets:
        assert sockets[0].poll(10_000, zmq.POLLIN), f"{req_id}: no answer to its pin"
    else:
        future.result(10)


def schedule_until_answered(connector: Any, request: Request) -> list[tuple]:
    """``get_num_new_matched_tokens`` as schedule() calls it, step after step, until it
    gives an answer; every answer in order."""
    answers = [connector.get_num_new_matched_tokens(request, 0)]
    deadline = time.monotonic() + 10.0
    while answers[-1][0] is None and time.monotonic() < deadline:
        time.sleep(0.005)
        answers.append(connector.get_num_new_matched_tokens(request, 0))
    return answers


def test_the_pin_is_asked_on_arrival_and_the_first_schedule_loads(decode_side) -> None:
    side = decode_side
    side.table.hold("prefill-1")
    request = decode_request(side, "decode-1", "prefill-1")
    side.connector.on_new_request(request)
    assert side.connector._direct_pins.in_flight() == 1  # sent from this thread, no handoff
    # pinned with no schedule() yet: the question left as the request arrived
    wait_for_state(side.table, "prefill-1", LeaseState.PINNED)
    wait_for_answer(side.connector, "decode-1")
    tokens, load_async = side.connector.get_num_new_matched_tokens(request, 0)
    assert tokens is not None and tokens > 0 and load_async  # loads at its first schedule()


def test_a_pin_from_long_before_the_first_schedule_is_asked_again(
    decode_side, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that queued since its pin on arrival reads only after a fresh answer (the
    same reader pinning again renews its pin)."""
    monkeypatch.setattr(lease, "REPIN_AFTER_S", 0.0)  # every early pin counts as old
    side = decode_side
    side.table.hold("prefill-4")
    request = decode_request(side, "decode-4", "prefill-4")
    side.connector.on_new_request(request)
    wait_for_answer(side.connector, "decode-4")
    first_pin = side.connector._pin_sent["decode-4"]
    answers = schedule_until_answered(side.connector, request)
    assert answers[0] == (None, False)  # asked again, not read on the old answer
    tokens, load_async = answers[-1]
    assert tokens is not None and tokens > 0 and load_async
    assert side.table.status("prefill-4").state is LeaseState.PINNED
    assert side.connector._pin_holds["decode-4"] > first_pin + side.table.pin_s


def test_a_request_aborted_after_its_pin_frees_the_prefill_blocks_at_once(decode_side) -> None:
    """Aborted while queued, after its pin on arrival was granted: the pin is its own, so
    vLLM's notice that frees the prefill's blocks goes out (not a pin held for pin_s)."""
    side = decode_side
    side.table.hold("prefill-5")
    request = decode_request(side, "decode-5", "prefill-5")
    side.connector.on_new_request(request)
    wait_for_answer(side.connector, "decode-5")
    request.status = RequestStatus.FINISHED_ABORTED
    side.connector.request_finished_all_groups(request, ([], []))
    assert "decode-5" in side.connector.connector_scheduler._reqs_need_recv  # the notice


def test_vllms_stand_in_for_a_rejected_request_is_neither_pinned_nor_refused(
    decode_side,
) -> None:
    """vLLM's API server hands the engine a one-token, pre-aborted stand-in for a decode
    request it rejected; it carries the prefill's parameters but is never read."""
    side = decode_side
    side.table.hold("prefill-6")
    params = decode_request(side, "x", "prefill-6").kv_transfer_params
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    request = Request("decode-6", [0], sampling, None, abort_immediately=True)
    side.connector.on_new_request(request)
    assert "decode-6" not in side.connector._pins
    assert "decode-6" not in side.connector._refused_early  # no refusal logged by name
    assert side.table.status("prefill-6").state is LeaseState.HELD


def test_a_request_whose_lease_is_gone_is_refused_by_name_at_its_first_schedule(
    decode_side,
) -> None:
    """The early pin changes when the question is asked, not what a refusal does."""
    side = decode_side
    side.table.hold("prefill-2")
    side.table.settle({"prefill-2"})  # read by another decode engine and freed
    request = decode_request(side, "decode-2", "prefill-2")
    side.connector.on_new_request(request)
    assert schedule_until_answered(side.connector, request)[-1][0] is not None
    refusal = side.connector._refused_reads.get("decode-2")  # the default policy: fail
    assert refusal and "released" in refusal and "prefill-2" in refusal, refusal


def test_a_prompt_that_is_not_the_prefilled_one_is_never_pinned(decode_side) -> None:
    """A decode leg carrying another request's parameters is refused before any pin, so it
    cannot take the blocks from the decode leg they belong to."""
    side = decode_side
    side.table.hold("prefill-3")
    request = decode_request(side, "decode-3", "prefill-3")
    request.prompt_token_ids[5] += 1  # another prompt under the same parameters
    side.connector.on_new_request(request)
    assert "decode-3" not in side.connector._pins
    assert "decode-3" in side.connector._refused_early
    assert side.table.status("prefill-3").state is LeaseState.HELD


@pytest.mark.parametrize("extra", [{}, {"direct_pins": False}], ids=["default", "off"])
def test_pins_through_the_background_thread_by_default(
    tiny_hybrid_model: Path, extra: dict
) -> None:
    """Without ``direct_pins``: the same pin on arrival, asked and answered by the
    background pinner; the first schedule() loads once it is in."""
    for connector in decode_connector(tiny_hybrid_model, extra):
        assert connector._direct_pins is None
        table = LeaseTable(lease_s=30.0, pin_s=30.0, forget_after_s=120)
        side = DecodeSide(connector, table, LeaseServer(table, "127.0.0.1"))
        table.hold("prefill-7")
        request = decode_request(side, "decode-7", "prefill-7")
        connector.on_new_request(request)
        connector._pins["decode-7"].result(10)  # settled by the pinner's thread, unasked
        tokens, load_async = connector.get_num_new_matched_tokens(request, 0)
        assert tokens is not None and tokens > 0 and load_async
        assert table.status("prefill-7").state is LeaseState.PINNED


def test_a_direct_pins_value_that_is_not_a_boolean_is_refused_by_name(
    tiny_hybrid_model: Path,
) -> None:
    with pytest.raises(ValueError, match="direct_pins is 'no'; expected true or false"):
        for _ in decode_connector(tiny_hybrid_model, {"direct_pins": "no"}):
            pass


def test_two_arrivals_for_one_prefill_are_both_pinned_and_read(decode_side) -> None:
    """The scheduler's thread has one question in flight per prefill engine; a request that
    arrives meanwhile is pinned in the background, and both load."""
    side = decode_side
    side.table.hold("prefill-8")
    side.table.hold("prefill-9")
    first = decode_request(side, "decode-8", "prefill-8")
    second = decode_request(side, "decode-9", "prefill-9")
    side.connector.on_new_request(first)
    side.connector.on_new_request(second)
    for request in (first, second):
        tokens, load_async = schedule_until_answered(side.connector, request)[-1]
        assert tokens is not None and tokens > 0 and load_async, request.request_id
    assert side.table.status("prefill-8").state is LeaseState.PINNED
    assert side.table.status("prefill-9").state is LeaseState.PINNED


def test_a_request_aborted_while_its_pin_is_unanswered_is_not_pinned_again(
    decode_side,
) -> None:
    """Its question to a silent lease service times out (lease_check_timeout, 2 s) and is
    dropped, not handed to the background pinner to pin blocks no one will read."""
    side = decode_side
    with silent_lease_service() as silent:
        request = decode_request(side, "decode-10", "prefill-10", lease_port=silent.port)
        side.connector.on_new_request(request)
        assert side.connector._direct_pins.in_flight() == 1
        request.status = RequestStatus.FINISHED_ABORTED
        side.connector.request_finished_all_groups(request, ([], []))
        deadline = time.monotonic() + 30.0
        while side.connector._direct_pins.in_flight():
            assert time.monotonic() < deadline, "the question never timed out"
            time.sleep(0.05)
            side.connector._direct_pins.collect()  # as each schedule() does
        assert silent.endpoint not in side.connector._pinner._peers._peers  # never asked again
