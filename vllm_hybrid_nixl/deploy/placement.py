"""Which CPU core each engine's compute threads are bound to (vLLM's CPU build).

Measured here: when a decode engine shares a core with the prefill engine it reads KV
from, the decode side's busy-waiting transfer thread starves the prefill side's NIXL/UCX
progress and single transfers stall for seconds to minutes (2 cores, 2 prefill + 1
decode). Keeping the roles on disjoint cores removed the stalls, so when there are fewer
cores than engines, prefill engines share one set of cores and decode engines another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def machine_id() -> str:
    """This kernel's boot id: the same for every raylet, container and network namespace on
    one machine, different on every other machine (the hostname when there is none)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def engine_cores(num_prefill: int, num_decode: int, cores: int) -> tuple[list[int], list[int]]:
    """Cores for the prefill engines and for the decode engines, in engine order."""
    if num_prefill < 0 or num_decode < 0 or cores < 1:
        raise ValueError(
            f"need non-negative engine counts and at least one core, got {num_prefill} prefill, "
            f"{num_decode} decode, {cores} cores"
        )
    total = num_prefill + num_decode
    if total <= cores:  # a core each
        return list(range(num_prefill)), list(range(num_prefill, total))
    if cores == 1 or num_prefill == 0 or num_decode == 0:
        return [i % cores for i in range(num_prefill)], [i % cores for i in range(num_decode)]
    # Fewer cores than engines: split the cores between the roles, in proportion, at least one each.
    decode_share = min(cores - 1, max(1, round(cores * num_decode / total)))
    prefill_set = list(range(cores - decode_share))
    decode_set = list(range(cores - decode_share, cores))
    return (
        [prefill_set[i % len(prefill_set)] for i in range(num_prefill)],
        [decode_set[i % len(decode_set)] for i in range(num_decode)],
    )


def engine_core_sets(
    num_prefill: int, num_decode: int, cores: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each engine's share of one node's ``cores``: with at least a core per engine, the
    cores are split into contiguous sets (prefill engines first, then decode engines, so the
    roles never share a core); with fewer, as :func:`engine_cores` (one core each)."""
    total = num_prefill + num_decode
    if total == 0 or total > cores:
        prefill, decode = engine_cores(num_prefill, num_decode, cores)
        return [[c] for c in prefill], [[c] for c in decode]
    share, extra = divmod(cores, total)
    sets, start = [], 0
    for index in range(total):
        size = share + (1 if index < extra else 0)
        sets.append(list(range(start, start + size)))
        start += size
    return sets[:num_prefill], sets[num_prefill:]


def cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    parts, ordered = [], sorted(set(cores))
    start = previous = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == previous + 1:
            previous = core
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if core is not None:
            start = previous = core
    return ",".join(parts)


@dataclass(frozen=True)
class PlacedEngine:
    """Where Ray put one engine: its machine (:func:`machine_id`) and the cores its raylet
    may use (the raylet's CPU affinity)."""

    name: str
    role: str  # prefill | decode
    machine: str
    cores: tuple[int, ...]


def core_shares(engines: list[PlacedEngine]) -> dict[str, list[int]]:
    """Each engine's cores. Engines whose raylets share a machine *and* a core set share
    those cores, whichever raylet they are on: several raylets on one machine (Ray's local
    clusters, several containers with one cpuset) would otherwise each hand out the same
    cores, putting a decode engine on its prefill engine's core (the stall above). Prefill
    and decode engines of a group get disjoint cores while there are enough
    (:func:`engine_core_sets`)."""
    groups: dict[tuple[str, tuple[int, ...]], list[PlacedEngine]] = {}
    for engine in engines:
        groups.setdefault((engine.machine, engine.cores), []).append(engine)
    shares: dict[str, list[int]] = {}
    for (_, cores), placed in groups.items():
        prefill = [e for e in placed if e.role == "prefill"]
        decode = [e for e in placed if e.role != "prefill"]
        prefill_sets, decode_sets = engine_core_sets(len(prefill), len(decode), len(cores))
        for engine, core_set in [
            *zip(prefill, prefill_sets, strict=True),
            *zip(decode, decode_sets, strict=True),
        ]:
            shares[engine.name] = [cores[i] for i in core_set]
    return shares
