"""Real prefill and decode ``vllm serve`` processes with ``HybridNixlConnector`` (pull mode),
registered by name through the plugin entry point, moving KV over real NIXL on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.digest_injection import (
    CONTROL_VARIABLE,
    MISMATCH_LINE,
    VERIFIED_LINE,
    arm,
    control_of,
    fired,
    hooked_env,
    run_injected,
    run_uncaught_damage,
)
from tests.e2e.pd_fixture import (
    COMMON_ARGS,
    WORKER_LINE,
    PdPair,
    metric_sum,
    run_pd_and_colocated,
    running_router,
    start_pair,
    wait_router_ready,
)
from vllm_hybrid_nixl.common.netutil import free_port, free_side_channel_port
from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.connector.progress_pacing import DEFAULT_POLL_US, POLL_KEY
from vllm_hybrid_nixl.connector.thread_priority import cpu_seconds
from vllm_hybrid_nixl.deploy.engines import EngineProcess, EngineSpec
from vllm_hybrid_nixl.deploy.pd_client import LegError, disaggregated_completion
from vllm_hybrid_nixl.router.backends import BackendPool
from vllm_hybrid_nixl.router.server import RouterServer

pytestmark = pytest.mark.e2e

#: Both engines pace NIXL's progress thread (opt-in; test_an_idle_engine_has_no_thread_...).
PACED = {POLL_KEY: DEFAULT_POLL_US}

PROMPTS = [
    "the decode engine reads the kv cache",
    # Longer than the 64-token sliding window and several 64-token blocks.
    " ".join(["the prefill engine computes every layer of the hybrid model"] * 12),
]


@pytest.fixture(scope="module")
def pair(tiny_hybrid_model, tmp_path_factory) -> Iterator[PdPair]:
    logs = tmp_path_factory.mktemp("pd-pull-logs")
    yield from start_pair(
        tiny_hybrid_model,
        logs,
        prefill={
            "connector": "HybridNixlConnector",
            "kv_extra_config": PACED,
            "env": hooked_env(logs / "p.json"),
        },
        decode={
            "connector": "HybridNixlConnector",
            "kv_extra_config": PACED,
            "env": hooked_env(logs / "d.json"),
        },
    )


def _digest_bodies(pair: PdPair, tag: str, count: int = 10) -> list[dict]:
    """Prompts unique to ``tag`` (no prefix-cache hit on the decode engine: every one is
    read), within one sliding window."""
    return [
        {
            "model": pair.model,
            "prompt": f"{tag} {i}: {PROMPTS[0]}",
            "max_tokens": 12,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        for i in range(count)
    ]


def _same_tokens(pd: dict, colocated: dict) -> bool:
    return pd["text"] == colocated["text"]


#: vLLM 0.25-0.27 workers report no failed loads the way the digest check needs: there the
#: engines say the digest is not available (test_the_decode_engine_says_...), and the
#: corruption tests have nothing to catch it with.
needs_digest = pytest.mark.skipif(
    not compat.digest_hooks_available(),
    reason=f"the KV digest needs vLLM 0.32+ ({compat.installed_release_text()} here)",
)


def test_the_decode_engine_says_whether_its_reads_are_verified(pair: PdPair) -> None:
    body = {"model": pair.model, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0.0}
    with httpx.Client(timeout=120.0) as client:
        disaggregated_completion(client, pair.prefill.spec.url, pair.decode.spec.url, body)
    log = pair.decode.log_text()
    if compat.digest_hooks_available():
        assert VERIFIED_LINE in log and "NOT verified" not in log
    else:
        assert "the KV digest is not available on" in log


@needs_digest
@pytest.mark.parametrize("where", ["received", "source"])
def test_every_corrupted_sliding_window_read_is_caught_and_rerun(pair: PdPair, where: str) -> None:
    """One flipped byte in a sliding-window page — received by the decode engine, or in the
    prefill's page after it was digested — fails the read; the router re-runs it and the
    client gets the colocated answer (0 wrong). Full attention and Mamba state:
    ``test_pd_mamba``."""
    pool = BackendPool.from_urls([pair.prefill.spec.url], [pair.decode.spec.url])
    with running_router(pool) as router_url:
        bodies = _digest_bodies(pair, f"window {where}")
        run_injected(pair, router_url, bodies, where, "sliding_window", _same_tokens)
    assert VERIFIED_LINE in pair.decode.log_text()


@needs_digest
def test_the_same_window_damage_unchecked_answers_wrong_tokens(pair: PdPair) -> None:
    """The negative control: a received sliding-window page overwritten after the check (as
    if nothing verified it) answers HTTP 200 with other tokens."""
    same = run_uncaught_damage(
        pair, _digest_bodies(pair, "unchecked", 3), "sliding_window", _same_tokens
    )
    assert not any(same), same


@pytest.fixture(scope="module")
def recompute_decode(pair: PdPair, tmp_path_factory) -> Iterator[EngineProcess]:
    """A second decode engine, as the first but with ``kv_load_failure_policy: recompute``
    (vLLM's default is fail), sharing core 1 with it; its corruption hook is idle."""
    logs = tmp_path_factory.mktemp("pd-pull-recompute-logs")
    spec = EngineSpec(
        model=pair.model,
        port=free_port(),
        role="decode",
        side_channel_port=free_side_channel_port(),
        cpu_core=1,
        extra_args=list(COMMON_ARGS),
        kv_extra_config=PACED,
        env=hooked_env(logs / "d.json"),
        kv_load_failure_policy="recompute",
    )
    engine = EngineProcess(spec, logs / "decode.log").start()
    try:
        engine.wait_healthy(timeout_s=420)
        yield engine
    finally:
        engine.stop()


def _prefill_alone(client: httpx.Client, pair: PdPair, body: dict) -> str:
    answer = client.post(f"{pair.prefill.spec.url}/v1/completions", json=body)
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"]


@needs_digest
def test_a_corrupted_read_under_recompute_is_computed_on_the_decode_engine(
    pair: PdPair, recompute_decode: EngineProcess
) -> None:
    """Under ``kv_load_failure_policy: recompute`` a read that fails the digest check is
    not an error: straight from the engines (no router, no re-run), HTTP 200 with the
    colocated answer, the mismatch logged as recomputed."""
    control = Path(recompute_decode.spec.env[CONTROL_VARIABLE])
    bodies = _digest_bodies(pair, "recompute", 4)
    wrong = []
    with httpx.Client(timeout=300.0) as client:
        for body in bodies:
            expected = _prefill_alone(client, pair, body)
            arm(control, "received", "sliding_window", 1)
            run = disaggregated_completion(
                client, pair.prefill.spec.url, recompute_decode.spec.url, body
            )
            assert fired(control) == 1
            if run.text != expected:
                wrong.append((body["prompt"], run.text, expected))
    assert not wrong, f"HTTP 200 with wrong tokens: {wrong}"
    log = recompute_decode.log_text()
    assert log.count(MISMATCH_LINE) == len(bodies)
    assert log.count("is recomputed on this engine (kv_load_failure_policy=recompute)") == len(
        bodies
    )
    assert recompute_decode.alive()


@needs_digest
def test_a_read_that_failed_its_check_leaves_nothing_in_the_decode_prefix_cache(
    pair: PdPair,
) -> None:
    """A multi-block prompt whose received full-attention page was damaged fails its read;
    the same prompt sent to the decode engine alone afterwards finds none of its blocks in
    the decode's prefix cache, and is answered as the prefill engine answers it. The
    control: after a clean P/D read of a second prompt, the same step does hit the cache
    (so this measurement sees caching where there is some)."""
    tail = PROMPTS[1]  # several 64-token blocks
    damaged, clean = (
        {"model": pair.model, "prompt": f"{tag}: {tail}", "max_tokens": 8, "temperature": 0.0}
        for tag in ("never cached", "cached as read")
    )
    control = control_of(pair, "decode")
    decode_url = pair.decode.spec.url
    hits = "vllm:prefix_cache_hits_total"
    with httpx.Client(timeout=300.0) as client:
        expected = _prefill_alone(client, pair, damaged)
        arm(control, "received", "full_attention", 1)
        with pytest.raises(LegError):
            disaggregated_completion(client, pair.prefill.spec.url, decode_url, damaged)
        assert fired(control) == 1
        before = metric_sum(decode_url, hits)
        again = client.post(f"{decode_url}/v1/completions", json=damaged).json()
        damaged_hits = metric_sum(decode_url, hits) - before
        disaggregated_completion(client, pair.prefill.spec.url, decode_url, clean)
        before = metric_sum(decode_url, hits)
        client.post(f"{decode_url}/v1/completions", json=clean).raise_for_status()
        clean_hits = metric_sum(decode_url, hits) - before
    assert damaged_hits == 0, f"{damaged_hits} prompt tokens came from a failed read's blocks"
    assert again["choices"][0]["text"] == expected
    assert clean_hits >= 64, clean_hits  # at least one whole block of the clean read


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_worker_process_runs_our_worker(pair: PdPair, side: str) -> None:
    engine = getattr(pair, side)
    matches = [m for m in WORKER_LINE.finditer(engine.log_text())]
    assert len(matches) == 1, f"expected one registration line in {engine.log_path}"
    line = matches[0]
    assert line["cls"] == "HybridNixlPullWorker"
    # The line comes from vLLM's worker process, not from the API server or the test.
    assert line["process"] in {"Worker", "EngineCore"} and line["pid"] == line["prefix_pid"]
    assert int(line["pid"]) != engine.pid
    assert (line["layers"], line["groups"], line["r"]) == ("4", "2", "1")


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "multi-block"])
def test_pd_output_equals_colocated_and_kv_came_over_nixl(pair: PdPair, prompt: str) -> None:
    body = {
        "model": pair.model,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    run = run_pd_and_colocated(pair, body)
    pd_choice, co_choice = run.pd_choice, run.colocated_choice
    assert pd_choice["token_ids"] == co_choice["token_ids"]
    assert pd_choice["text"] == co_choice["text"]
    assert len(pd_choice["token_ids"]) == 20
    # The decode engine computed nothing of the prompt but (at most) its last token.
    assert run.moved.external_prompt_tokens >= run.prompt_tokens - 1
    assert run.moved.nixl_bytes > 0
    assert run.moved.failed_transfers == 0


def test_decode_leg_error_names_the_leg_and_engine(pair: PdPair) -> None:
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 2}
    with httpx.Client(timeout=60.0) as client, pytest.raises(LegError) as info:
        disaggregated_completion(client, pair.prefill.spec.url, pair.decode.spec.url, body)
    assert str(info.value).startswith(
        f"prefill leg: engine {pair.prefill.spec.url} answered HTTP 404"
    )


def test_the_router_asks_each_engines_side_channel_in_its_releases_form(pair: PdPair) -> None:
    """The router reads each engine's vLLM release from its /version and speaks that
    release's side-channel form (the other form kills vLLM's listener thread): both layouts
    are read, and the engines still hand out their handshake and serve P/D afterwards. The
    version matrix runs this on every release (0.25.1 speaks the other form)."""

    pool = BackendPool.from_urls(
        [pair.prefill.spec.url],
        [pair.decode.spec.url],
        [pair.prefill.spec.side_channel],
        [pair.decode.spec.side_channel],
    )
    router = RouterServer(pool, "127.0.0.1", free_port()).start()
    try:
        wait_router_ready(router.url, layouts=True)
        health = httpx.get(f"{router.url}/health", timeout=30).json()
        layouts = [engine["layout"] for engine in health["engines"]]
        assert all("block_size=64" in layout for layout in layouts), layouts
        assert health["pairing_problems"] == []
        body = {"model": pair.model, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0.0}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text  # the listener threads survived
    finally:
        router.stop()


def thread_cpu_shares(pid: int, seconds: float) -> dict[int, float]:
    """Each thread of process ``pid``: the share of a core it used over ``seconds``."""
    threads = [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]
    before = {tid: cpu_seconds(tid, pid) for tid in threads}
    time.sleep(seconds)
    return {tid: (cpu_seconds(tid, pid) - before[tid]) / seconds for tid in threads}


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_idle_engine_has_no_thread_polling_a_core(pair: PdPair, side: str) -> None:
    """With ``progress_poll_us`` set, NIXL's progress thread waits for transport events
    instead of busy-polling; otherwise it holds a whole core of every idle engine. vLLM's own
    worker polls its step queue for a second after each step, so the sample starts after
    that."""
    engine = getattr(pair, side)
    worker_pid = int(next(WORKER_LINE.finditer(engine.log_text()))["pid"])
    assert "instead of busy-polling a core" in engine.log_text()
    time.sleep(2.0)
    shares = thread_cpu_shares(worker_pid, 2.0)
    busy = {tid: round(share, 2) for tid, share in shares.items() if share > 0.3}
    assert not busy, f"threads of the {side} worker (pid {worker_pid}) polling a core: {busy}"
