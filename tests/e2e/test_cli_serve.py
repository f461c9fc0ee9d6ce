"""`vllm-hybrid-nixl demo` and `serve` run as users run them: as processes, checked by their
output, exit code, and that nothing they started outlives them."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(sys.executable).with_name("vllm-hybrid-nixl"))


def start(args: list[str], cwd: Path, cores: set[int] | None = None) -> subprocess.Popen[str]:
    """Run the CLI in its own session, so everything it starts can be found afterwards
    (confined to ``cores`` when given, as ``taskset`` or a container's cpuset would)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [SCRIPT, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=None if cores is None else (lambda: os.sched_setaffinity(0, cores)),
    )


def session_members(session_id: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session_id:
                    members.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return members


def wait_session_empty(session_id: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = session_members(session_id)
        if not left:
            return []
        time.sleep(1.0)
    return session_members(session_id)


def engine_pids(log_dir: Path) -> set[int]:
    """PIDs of every vLLM process (API server, engine core, worker) that wrote a log there.

    Engines run in sessions of their own, so they are found from their logs instead.
    """
    pids: set[int] = set()
    for log in log_dir.glob("*.log"):
        pids.update(
            int(p)
            for p in re.findall(
                r"\((?:APIServer|EngineCore|Worker) pid=(\d+)\)", log.read_text(errors="replace")
            )
        )
    return pids


def alive(pids: set[int]) -> set[int]:
    living = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            living.add(pid)
        except ProcessLookupError:
            continue
    return living


def kill_pids(pids: set[int] | list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_session(session_id: int) -> None:
    kill_pids(session_members(session_id))


@pytest.fixture(autouse=True)
def no_engine_outlives_its_test(tmp_path: Path) -> Iterator[None]:
    """Engines run in sessions of their own: after a failed test, every engine process that
    logged under the test's ``logs`` directory is killed, so none spins on into later tests."""
    yield
    kill_pids(alive(engine_pids(tmp_path / "logs")))


def finish(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The process's whole output once it exits; past ``timeout_s`` its session is killed
    and the test fails with what it printed (not a bare timeout)."""
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return output
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"still running after {timeout_s:.0f} s; its output:\n{output[-6000:]}")
    finally:
        kill_session(proc.pid)


class OutputLines:
    """A process's output lines, read on one thread from the start, so a silent process
    cannot block the test past its time."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                self.lines.put(line)
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, prefixes: tuple[str, ...], timeout_s: float) -> list[str]:
        """The lines printed from here up to the first that starts with one of ``prefixes``
        (or all printed before the process exited or ``timeout_s`` passed)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if line.startswith(prefixes):
                break
        return seen or [""]


def test_demo_matches_colocated_and_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = start(["demo", "--log-dir", str(tmp_path / "logs")], cwd=tmp_path)
    output = finish(proc, timeout_s=600)
    assert proc.returncode == 0, output[-4000:]
    assert "RESULT: OK" in output
    assert len(re.findall(r"^prompt \d+ \(\d+ tokens\): MATCH$", output, re.M)) == 8
    moved = re.search(r"KV over NIXL: (\d+) of (\d+) prompt tokens, (\d+) bytes, 0 failed", output)
    assert moved and int(moved[3]) > 0
    assert int(moved[1]) >= int(moved[2]) - 8  # no prompt recomputed on the decode side
    assert re.search(r"wall time: set-up \d+s, engine start \d+s, serving \d+s", output)
    assert wait_session_empty(proc.pid) == []
    pids = engine_pids(tmp_path / "logs")
    assert len(pids) >= 6  # 2 engines x (API server, engine core, worker)
    assert alive(pids) == set()


def test_serve_prints_router_and_stops_everything_on_sigterm(
    tmp_path: Path, tiny_hybrid_model
) -> None:
    """``serve`` prints its router, restarts every engine on SIGHUP (the old processes gone,
    the same greedy answer after), and stops everything it started on SIGTERM."""
    proc = start(
        [
            "serve",
            "--model",
            str(tiny_hybrid_model),
            "--block-size",
            "64",
            "--router-port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            "--enforce-eager",
            "--max-model-len",
            "512",
        ],
        cwd=tmp_path,
    )
    try:
        output = OutputLines(proc)
        lines = output.until(("router: ",), timeout_s=300)
        assert lines[-1].startswith("router: "), "".join(lines)[-4000:]
        router = lines[-1].split()[1]
        assert httpx.get(f"{router}/health", timeout=30).json()["status"] == "ok"
        body = {"model": str(tiny_hybrid_model), "prompt": "hello there", "max_tokens": 4}
        body.update(temperature=0.0, ignore_eos=True)
        first = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200
        before = engine_pids(tmp_path / "logs")
        assert len(before) >= 6  # 2 engines x (API server, engine core, worker)
        # SIGHUP: every engine drains and restarts in turn; serve keeps serving.
        proc.send_signal(signal.SIGHUP)
        lines = output.until(("rolling restart done", "error: rolling restart"), timeout_s=600)
        assert lines[-1].startswith("rolling restart done"), "".join(lines)[-4000:]
        assert alive(before) == set(), "an engine process of before the restart still runs"
        again = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text[:500]
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        pids = engine_pids(tmp_path / "logs")
        assert len(pids - before) >= 6, "the restarted engines' processes are not in the logs"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # the reader thread drains its output
        assert proc.returncode == 0
        assert wait_session_empty(proc.pid) == []
        assert alive(pids) == set()
    finally:
        kill_session(proc.pid)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "/no/such/model-dir"],
            "model directory '/no/such/model-dir' does not exist or has no config.json",
        ),
        (
            ["--model", "MODEL", "--connector", "MadeUpConnector"],
            "unknown connector 'MadeUpConnector'; use one of HybridNixlConnector",
        ),
        (
            ["--model", "MODEL", "--num-prefill", "3", "--num-decode", "3"],
            "3 prefill + 3 decode engines do not fit the Ray cluster (CPU: need 6, cluster has",
        ),
    ],
    ids=["missing-model", "unknown-connector", "too-many-engines"],
)
def test_bad_deployment_fails_fast_with_a_clear_error(
    tmp_path: Path, tiny_hybrid_model, args: list[str], message: str
) -> None:
    args = [str(tiny_hybrid_model) if a == "MODEL" else a for a in args]
    logs = ["--log-dir", str(tmp_path / "logs")]
    proc = start(["serve", *args, *logs, "--router-port", "0"], cwd=tmp_path)
    output = finish(proc, timeout_s=180)
    assert proc.returncode == 2, output[-3000:]
    assert message in output
    assert "router: " not in output
    assert wait_session_empty(proc.pid) == []


def test_a_local_cluster_counts_only_the_cores_the_cli_may_use(
    tmp_path: Path, tiny_hybrid_model
) -> None:
    """Ray's own CPU count ignores CPU affinity; confined to one core, ``serve`` must see a
    one-CPU cluster and refuse two engines before starting any (not plan them onto cores it
    cannot use)."""
    args = ["--model", str(tiny_hybrid_model), "--num-prefill", "1", "--num-decode", "1"]
    logs = ["--log-dir", str(tmp_path / "logs")]
    proc = start(["serve", *args, *logs, "--router-port", "0"], cwd=tmp_path, cores={0})
    output = finish(proc, timeout_s=180)
    assert proc.returncode == 2, output[-3000:]
    refusal = "1 prefill + 1 decode engines do not fit the Ray cluster (CPU: need 2, cluster has 1)"
    assert refusal in output, output[-3000:]
    assert wait_session_empty(proc.pid) == []
