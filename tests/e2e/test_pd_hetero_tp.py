"""Heterogeneous tensor parallelism through real engines: a TP=1 prefill engine and a TP=2
decode engine (vLLM's CPU build runs TP=2 as two worker processes, one per core).

Plain model: stock NIXL supports this, and so do we: the router's pairing and the engines
accept the pair, and P/D answers equal the prefill engine's own, with the prompt's
KV read over NIXL by both decode ranks. Mamba2 hybrid whose B/C groups split over TP 2
(n_groups 2): served the same way, each decode rank verifying the prefill's per-rank layout.
In both, every decode rank's read of its half of the prefill's pages is verified byte for
byte by the KV digest (the prefill's cells of that half); a byte flipped in what a decode rank
received (``tests/harness/kv_corruption_site``) is caught and never answered as HTTP 200 with
other tokens. A decode leg replayed after its read is refused by its lease before either
decode rank reads.
Sliding-window hybrid from a TP 2 prefill into a TP 1 decode (stock vLLM's smaller decode
TP died reading a larger prefill TP's hybrid KV): the router and the decode engine refuse it
by name. ``check`` gives the same verdicts for the same models, and refuses a Mamba2 hybrid
whose one B/C group TP 2 replicates (stock NIXL answers it with wrong tokens)
(``tests/integration/test_check.py``, a dry run without engines: here it cost a minute per
pair beside running engines).

Two cores for three processes: the decode ranks' busy-polling NIXL progress threads, although
at idle priority, slowed a normal process sharing their core 18-170x on this VM (measured: a
2 s CPU probe took 33 s beside one, 312 s beside two). The prefill engine shares core 0 with
decode rank 0, so its lease service can answer late: the decode engine here waits 30 s for it
(``lease_check_timeout``; 2 s by default)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.digest_injection import (
    MISMATCH_LINE,
    VERIFIED_LINE,
    arm,
    control_of,
    fired,
    hooked_env,
)
from tests.e2e.pd_fixture import (
    COMMON_ARGS,
    PdPair,
    PdVersusColocated,
    run_pd_and_colocated,
    start_pair,
)
from vllm_hybrid_nixl.deploy.engines import stop_engines
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion, prefill_body
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.pairing import PairingTable
from vllm_hybrid_nixl.tools.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.e2e

WORDS = "the decode engine splits its kv heads over two ranks"
#: The decode engine's log lines when a replayed leg is refused: its pin (the prefill
#: released the blocks, or another decode request pinned them) or its claim (another decode
#: request on this engine reads those blocks).
LEASE_REFUSALS = (
    "released its KV blocks",
    "already pinned these blocks",
    "already reads those blocks",
)


def lease_refusals(pair: PdPair) -> int:
    log = pair.decode.log_text()
    return sum(log.count(line) for line in LEASE_REFUSALS)


PROMPTS = [f"tp {i}: " + " ".join([WORDS] * n) for i, n in enumerate([1, 11])]


def start_hetero_pair(model: Path, log_dir: Path) -> Iterator[PdPair]:
    """A TP 1 prefill and a TP 2 decode whose ranks load the corruption hook (idle)."""
    decode = {
        "extra_args": [*COMMON_ARGS, "--tensor-parallel-size", "2"],
        "cpu_core": None,
        "env": {
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank
            **hooked_env(log_dir / "decode-corruption.json"),
        },
        "kv_extra_config": {"lease_check_timeout": 30.0},  # see the module docstring
    }
    yield from start_pair(model, log_dir, {}, decode)


def assert_split_reads_verified(pair: PdPair) -> None:
    """Both decode ranks verified their half-page reads (none logged as unverified)."""
    log = pair.decode.log_text()
    assert "NOT verified byte for byte" not in log, log[-3000:]
    verified = [line for line in log.splitlines() if VERIFIED_LINE in line]
    assert {"Worker_TP0", "Worker_TP1"} <= {
        rank for line in verified for rank in ("Worker_TP0", "Worker_TP1") if rank in line
    }, verified


def assert_replayed_decode_leg_is_refused(pair: PdPair, prompt: str) -> None:
    """A decode leg sent again with the parameters of one already read: the decode engine's
    scheduler refuses it (its claim, or its lease pin: the prefill released the blocks), so
    neither decode rank reads, and the answer is an error or the prompt computed afresh,
    never other tokens."""
    body = {"model": pair.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=300) as client:
        prefill = client.post(f"{pair.prefill.spec.url}/v1/completions", json=prefill_body(body))
        params = prefill.json()["kv_transfer_params"]
        decode = {**body, "kv_transfer_params": params}
        first = client.post(f"{pair.decode.spec.url}/v1/completions", json=decode)
        assert first.status_code == 200, first.text[:500]
        before = lease_refusals(pair)
        again = client.post(f"{pair.decode.spec.url}/v1/completions", json=decode)
    if again.status_code == 200:
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert lease_refusals(pair) > before, pair.decode.log_text()[-3000:]


def assert_received_corruption_is_caught(pair: PdPair, kind: str, prompt: str) -> None:
    """One byte flipped in a page a decode rank received: the digest mismatch is logged
    naming the group, and the answer is an error or the colocated one, never other tokens."""
    control = control_of(pair, "decode")
    body = {"model": pair.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    before = pair.decode.log_text().count(MISMATCH_LINE)
    arm(control, "received", kind, 1)
    try:
        run = run_pd_and_colocated(pair, body)
    except LegError:
        run = None  # failed, not answered (kv_load_failure_policy=fail)
    assert fired(control) == 1
    log = pair.decode.log_text()
    lines = [line for line in log.splitlines() if MISMATCH_LINE in line]
    assert len(lines) == before + 1, log[-3000:]
    assert f"({kind}), first at logical block " in lines[-1], lines[-1]
    if run is not None:
        assert run.pd_choice["text"] == run.colocated_choice["text"]


def pairing_problem(pair: PdPair) -> str:
    """What the router's pairing says of this pair, from the engines' side channels."""
    pool = BackendPool.from_urls(
        [pair.prefill.spec.url],
        [pair.decode.spec.url],
        [pair.prefill.spec.side_channel],
        [pair.decode.spec.side_channel],
    )
    table = PairingTable(pool.all(), timeout_s=30.0)
    table.refresh()
    return table.problem(pool.prefill[0], pool.decode[0])


def warm_up(pair: PdPair, attempts: int = 3) -> PdVersusColocated:
    """Requests the short prompt until one moves its KV without a failed transfer, and
    returns that run. Three processes on two cores: the first handshake between the engines
    can miss vLLM's 5 s side-channel read (seen in CI); vLLM handshakes again on the next
    request."""
    body = {"model": pair.model, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    outcomes = []
    for _ in range(attempts):
        try:
            run = run_pd_and_colocated(pair, body)
        except LegError as exc:  # the failed load answered as an error
            outcomes.append(str(exc))
            continue
        if run.moved.failed_transfers == 0 and run.moved.nixl_bytes > 0:
            return run
        outcomes.append(str(run.moved))
    pytest.fail(f"no clean KV transfer in {attempts} warm-up requests: {outcomes}")


@dataclass
class PlainCase:
    pair: PdPair


@pytest.fixture(scope="module")
def plain_case(tmp_path_factory) -> Iterator[PlainCase]:
    model = build_tiny_model(tmp_path_factory.mktemp("tp-llama"), TinyModelSpec(arch="llama"))
    for pair in start_hetero_pair(model, tmp_path_factory.mktemp("tp-plain-logs")):
        warm_up(pair)
        yield PlainCase(pair)


def test_plain_model_tp1_to_tp2_is_served_and_equals_colocated(plain_case: PlainCase) -> None:
    plain_pair = plain_case.pair
    assert pairing_problem(plain_pair) == ""
    for prompt in PROMPTS:
        body = {"model": plain_pair.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        run = run_pd_and_colocated(plain_pair, body)  # a failed leg names the decode's errors
        assert run.pd_choice["text"] == run.colocated_choice["text"], prompt
        assert run.moved.nixl_bytes > 0 and run.moved.failed_transfers == 0
        assert run.moved.external_prompt_tokens >= run.prompt_tokens - 1
    log = plain_pair.decode.log_text()
    assert "Worker_TP0" in log and "Worker_TP1" in log
    assert log.count("validated 4 KV-cache layers") == 2  # our worker on both ranks
    assert_split_reads_verified(plain_pair)
    assert_received_corruption_is_caught(plain_pair, "full_attention", "corrupt " + PROMPTS[1])


def test_mamba_hybrid_tp1_to_tp2_is_served_and_equals_colocated(
    plain_case: PlainCase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # two cores: the hybrid pair needs them
    stop_engines([plain_case.pair.prefill, plain_case.pair.decode])
    spec = TinyModelSpec(arch="nemotron-h", mamba_groups=2)
    model = build_tiny_model(tmp_path_factory.mktemp("tp-nemotron-g2"), spec)
    pair_iter = start_hetero_pair(model, tmp_path_factory.mktemp("tp-mamba-logs"))
    pair = next(pair_iter)
    try:
        short = warm_up(pair)
        assert short.pd_choice["text"] == short.colocated_choice["text"]
        assert pairing_problem(pair) == ""
        # the long prompt (11 blocks' worth of words); the short one went P/D in the warm-up
        # (three processes on two cores make every request here slow)
        for prompt in PROMPTS[1:]:
            body = {"model": pair.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            run = run_pd_and_colocated(pair, body)
            assert run.pd_choice["text"] == run.colocated_choice["text"], prompt
            assert run.moved.nixl_bytes > 0 and run.moved.failed_transfers == 0
        log = pair.decode.log_text()
        assert "Worker_TP0" in log and "Worker_TP1" in log
        # each decode rank checked the prefill's TP 1 layout against its own TP 2 slice
        verified = log.count("has TP 1, this engine TP 2; per-rank layouts correspond")
        assert verified >= 2, log[-3000:]
        assert_split_reads_verified(pair)
        assert_received_corruption_is_caught(pair, "mamba", "corrupt " + PROMPTS[1])
        assert_replayed_decode_leg_is_refused(pair, "replay " + PROMPTS[0])
    finally:
        pair_iter.close()


def test_hybrid_into_a_smaller_decode_tp_is_refused_by_router_and_engine(
    plain_case: PlainCase, tiny_hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A sliding-window hybrid from a TP 2 prefill into a TP 1 decode: stock vLLM 0.32's TP 1
    decode engine died reading a TP 2 prefill's hybrid KV (bench/hetero_tp.py); the router's
    pairing and the decode engine refuse it by name, naming both TP sizes."""
    prefill = {
        "extra_args": [*COMMON_ARGS, "--tensor-parallel-size", "2"],
        "cpu_core": None,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank
        # No lease: this test is about the layout. Beside its two busy-polling ranks, a TP 2
        # prefill's lease service answered a pin only after 30-120 s (CI and here), so the
        # request failed on its lease before the handshake that refuses the layout.
        "kv_extra_config": {"lease_guard": False},
    }
    decode = {"kv_extra_config": {"lease_guard": False}}
    # stopped already when the Mamba test ran first; two cores
    stop_engines([plain_case.pair.prefill, plain_case.pair.decode])
    log_dir = tmp_path_factory.mktemp("tp-refused-logs")
    # the single-rank engine first: beside two busy-polling NIXL ranks it came up slowly
    pair_iter = start_pair(tiny_hybrid_model, log_dir, prefill, decode, decode_first=True)
    pair = next(pair_iter)
    try:
        problem = pairing_problem(pair)
        assert "prefill TP 2 into a smaller decode TP 1 is not served" in problem, problem
        body = {"model": pair.model, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=120.0) as client, pytest.raises(LegError) as info:
            disaggregated_completion(client, pair.prefill.spec.url, pair.decode.spec.url, body)
        assert "decode leg" in str(info.value)
        log = pair.decode.log_text()
        assert "refused KV transfer" in log, log[-3000:]
        assert "prefill TP 2 into a smaller decode TP 1" in log, log[-3000:]
    finally:
        pair_iter.close()
