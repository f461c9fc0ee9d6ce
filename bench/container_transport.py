"""NIXL between two containers: which UCX transport carries a READ and what it moves, per
namespace setting, side by side in one run (rounds alternate the settings).

    python -m bench.container_transport [--image IMAGE] [--rounds 2] [--total-mib 64]

A *holder* container registers a DRAM buffer with its NIXL agent and leaves its agent
metadata in a directory both containers mount; a *reader* container READs the buffer in
blocks the way vLLM's worker does (``bench.transfer``'s agents and descriptor lists) and
checks the bytes. UCX reports the protocol it chose for the READ (``UCX_PROTO_INFO=y``).
Settings compared, each container on the engine's default bridge network unless said:

- ``private``: own network address, IPC and PID namespaces (compose, ``docker run``);
- ``shared-ipc``: the reader joins the holder's IPC namespace (``--ipc=container:H``);
- ``shared-ipc-pid``: and its PID namespace (``--pid=container:H``);
- ``host``: ``--network=host --ipc=host --pid=host`` (no isolation).

The engine is podman where installed (it honours ``CONTAINERS_CONF``), else docker; the image
is one built from ``Dockerfile.cpu`` (``tests/e2e/test_containers.py`` builds it).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZES = [256 << 10, 4 << 20]
SETTINGS = {
    "private": ([], []),
    "shared-ipc": (["--ipc=shareable"], ["--ipc=container:{holder}"]),
    "shared-ipc-pid": (
        ["--ipc=shareable"], ["--ipc=container:{holder}", "--pid=container:{holder}"]
    ),
    "host": (["--network=host", "--ipc=host", "--pid=host"],) * 2,
}  # fmt: skip
READ_TITLE = re.compile(r"remote memory read by ucp_get")
ROW = re.compile(r"\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*$")


def _holder(directory: Path, total: int) -> None:
    import torch

    from bench.transfer import _agent

    agent = _agent(f"holder-{uuid.uuid4().hex[:6]}")
    buffer = torch.randint(0, 255, (total,), dtype=torch.uint8)
    agent.register_memory(buffer)
    meta = (agent.get_agent_metadata(), buffer.data_ptr(), int(buffer.sum()))
    (directory / "holder.tmp").write_bytes(pickle.dumps(meta))
    (directory / "holder.tmp").rename(directory / "holder.meta")
    deadline = time.monotonic() + 600
    while not (directory / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _reader(directory: Path, total: int, repeats: int) -> None:
    import torch

    from bench.transfer import _agent, _descs, _wait

    deadline = time.monotonic() + 120
    while not (directory / "holder.meta").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the holder left no NIXL metadata")
        time.sleep(0.2)
    metadata, remote_base, checksum = pickle.loads((directory / "holder.meta").read_bytes())
    agent = _agent(f"reader-{uuid.uuid4().hex[:6]}")
    local = torch.zeros(total, dtype=torch.uint8)
    agent.register_memory(local)
    remote = agent.add_remote_agent(metadata)
    rows = []
    for size in BLOCK_SIZES:
        indices = list(range(total // size))
        mine = agent.prep_xfer_dlist("", _descs(local.data_ptr(), total, size), "DRAM")
        theirs = agent.prep_xfer_dlist(remote, _descs(remote_base, total, size), "DRAM")
        seconds = []
        for attempt in range(repeats + 1):  # the first sets up the endpoint: not timed
            local.zero_()
            handle = agent.make_prepped_xfer("READ", mine, indices, theirs, indices)
            started = time.perf_counter()
            _wait(agent, handle, timeout_s=300)
            if attempt:
                seconds.append(time.perf_counter() - started)
            agent.release_xfer_handle(handle)
            if int(local.sum()) != checksum:
                raise RuntimeError("the READ did not bring the holder's bytes")
        rows.append({"block_bytes": size, "gbs": total / statistics.median(seconds) / 1e9})
    (directory / "result.json").write_text(json.dumps(rows))
    (directory / "done").write_text("")


def _engine() -> str:
    found = shutil.which("podman") or shutil.which("docker")
    if found is None:
        raise SystemExit("no container engine (podman or docker) on PATH")
    return found


def read_protocols(log: str) -> list[str]:
    """The transports UCX chose for remote-memory READs (its ``UCX_PROTO_INFO`` tables)."""
    found, capturing = [], False
    for line in log.splitlines():
        if READ_TITLE.search(line):
            capturing = True
            continue
        match = ROW.search(line)
        if capturing and match and match.group(1) != "Range":
            found.append(match.group(3))
        elif capturing and found and "+--" not in line:
            capturing = False  # the next table's title
    return sorted(set(found))


def _shm(flags: list[str]) -> list[str]:
    """``--shm-size`` where the container has an IPC namespace of its own (the engine
    refuses it beside ``--ipc=host`` or a joined namespace)."""
    joined = any(flag.startswith("--ipc=") and flag != "--ipc=shareable" for flag in flags)
    return [] if joined else ["--shm-size", "1g"]


def run_setting(engine: str, image: str, setting: str, total_mib: int, repeats: int) -> dict:
    holder_flags, reader_flags = SETTINGS[setting]
    tag = uuid.uuid4().hex[:8]
    holder, reader = f"vhn-bench-holder-{tag}", f"vhn-bench-reader-{tag}"
    with tempfile.TemporaryDirectory(prefix="vhn-bench-") as raw:
        directory = Path(raw)
        directory.chmod(0o777)  # the image's user (uid 1000) writes here
        common = ["-v", f"{REPO}:/src:ro", "-v", f"{directory}:/x", "-e", "PYTHONPATH=/src"]
        common += ["--entrypoint", "python", image]
        command = ["-m", "bench.container_transport"]
        sizes = ["--dir", "/x", "--total-mib", str(total_mib), "--repeats", str(repeats)]
        try:
            subprocess.run(
                [engine, "run", "-d", "--name", holder, *holder_flags, *_shm(holder_flags),
                 *common, *command, "holder", *sizes],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
            flags = [f.format(holder=holder) for f in reader_flags]
            reading = subprocess.run(
                [engine, "run", "--name", reader, "-e", "UCX_PROTO_INFO=y", *flags,
                 *_shm(flags), *common, *command, "reader", *sizes],
                capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if reading.returncode != 0:
                raise RuntimeError(f"{setting}: the reader failed:\n{reading.stderr[-3000:]}")
            rows = json.loads((directory / "result.json").read_text())
            protocols = read_protocols(reading.stdout + reading.stderr)
        finally:
            for name in (reader, holder):
                subprocess.run([engine, "rm", "-f", "-t", "5", name], capture_output=True)
    return {"setting": setting, "read_via": protocols, "blocks": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=["holder", "reader"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--image", default="localhost/vllm-hybrid-nixl:cpu-test")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--json", type=Path, default=RESULTS / "container_transport.json")
    args = parser.parse_args(argv)
    total = args.total_mib << 20
    if args.role == "holder":
        _holder(args.dir, total)
        return 0
    if args.role == "reader":
        _reader(args.dir, total, args.repeats)
        return 0
    engine = _engine()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(args.rounds):
        for setting in SETTINGS:
            print(f"round {round_index + 1}: {setting}", file=sys.stderr, flush=True)
            result = run_setting(engine, args.image, setting, args.total_mib, args.repeats)
            runs[setting].append(result)
            speeds = ", ".join(
                f"{r['block_bytes'] >> 10} KiB {r['gbs']:.2f} GB/s" for r in result["blocks"]
            )
            print(f"  READ via {result['read_via']}: {speeds}", file=sys.stderr, flush=True)
    summary = []
    for setting, results in runs.items():
        for index, size in enumerate(BLOCK_SIZES):
            speeds = [r["blocks"][index]["gbs"] for r in results]
            summary.append(
                {
                    "setting": setting,
                    "read_via": sorted({p for r in results for p in r["read_via"]}),
                    "block_bytes": size,
                    "gbs_median": statistics.median(speeds),
                }
            )
    base = {(r["block_bytes"]): r["gbs_median"] for r in summary if r["setting"] == "private"}
    for row in summary:
        row["vs_private"] = row["gbs_median"] / base[row["block_bytes"]]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"image": args.image, "engine": Path(engine).name, "total_mib": args.total_mib}
    payload.update(rounds=args.rounds, repeats=args.repeats, summary=summary, runs=runs)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    for row in summary:
        via = ",".join(row["read_via"])
        print(
            f"{row['setting']:>15} {row['block_bytes'] >> 10:>5} KiB via {via}: "
            f"{row['gbs_median']:.2f} GB/s ({row['vs_private']:.2f}x private)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
