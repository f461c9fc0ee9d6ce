"""Hybrid engines with different tensor-parallel sizes: which per-rank facts must correspond.

Plain data, no vLLM import. A hybrid fingerprint carries its TP size and per-rank facts (each
group's page bytes, each Mamba state tensor's per-rank shape). Between different TP sizes those
differ by design; what must hold instead is that every rank holds an exact slice of the same
global layout, because vLLM's NIXL worker cuts each remote rank's bytes by that assumption:

- the TP sizes divide each other, the pair runs the pull (READ) connector, and the decode TP
  is at least the prefill TP (vLLM's NIXL claims both directions for Mamba; stock vLLM 0.32's
  TP 1 decode engine died reading a TP 2 prefill's hybrid KV, so that direction is refused
  until it has run); an attention group's per-rank page is the same bytes per KV head on both
  sides (where no Mamba group pads the pages);
- a Mamba / linear-attention state tensor has the same kind, rank and dtype on both sides, all
  dimensions equal but at most one, and that one split exactly (per-rank size x TP equal): a
  state that vLLM replicates on one side only (Mamba2 with ``n_groups`` not divisible by TP
  pads B/C groups per rank) breaks this, and stock NIXL reads it at the wrong offsets
  (measured: HTTP 200 with wrong tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Per-rank group fields: they differ between TP sizes and are judged by this module instead.
PER_RANK_GROUP_FIELDS = ("page_bytes", "state")

SAME_TP_HINT = "or start both engines with the same --tensor-parallel-size"


@dataclass(frozen=True)
class SplitProblem:
    """One fact that does not correspond between the two TP sizes, and what to change."""

    field: str
    local: object
    remote: object
    hint: str


@dataclass(frozen=True)
class StateTensors:
    """A Mamba group's ``state`` fingerprint string, parsed: ``mamba2 (288,3)+(8,32,16)
    float32+float32``."""

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> StateTensors | None:
        """None unless ``text`` is exactly ``kind (d,..)+(d,..) dtype+dtype`` with one dtype
        per shape."""
        match = _STATE_PATTERN.fullmatch(text)
        if match is None:
            return None
        kind, shapes, dtypes = match.groups()
        found = tuple(
            tuple(int(d) for d in item.split(",")) for item in re.findall(r"\(([0-9,]+)\)", shapes)
        )
        names = tuple(dtypes.split("+"))
        if len(found) != len(names):
            return None
        return cls(kind=kind, shapes=found, dtypes=names)


_SHAPE = r"\([0-9]{1,18}(?:,[0-9]{1,18})*\)"  # ASCII digits, within int64
_STATE_PATTERN = re.compile(rf"(\S+) ({_SHAPE}(?:\+{_SHAPE})*) ([\w.]+(?:\+[\w.]+)*)")


def _splits_exactly(
    own: tuple[int, ...], other: tuple[int, ...], tp_own: int, tp_other: int
) -> bool:
    """Same rank, all dimensions equal but at most one, that one an exact split."""
    if len(own) != len(other):
        return False
    differing = [(a, b) for a, b in zip(own, other, strict=True) if a != b]
    if not differing:
        return tp_own == tp_other  # a state replicated on every rank is not a slice
    if len(differing) > 1:
        return False
    ((a, b),) = differing
    return a * tp_own == b * tp_other


def _state_problem(
    index: int, local: str, remote: str, tp_local: int, tp_remote: int
) -> SplitProblem | None:
    mine, theirs = StateTensors.parse(local), StateTensors.parse(remote)
    name = f"groups[{index}].state"
    if mine is None or theirs is None:
        return SplitProblem(
            name,
            local,
            remote,
            "this state description cannot be compared across TP sizes; "
            + SAME_TP_HINT.removeprefix("or "),
        )
    if mine.kind != theirs.kind or mine.dtypes != theirs.dtypes:
        return SplitProblem(name, local, remote, _STATE_KIND_HINT)
    if len(mine.shapes) != len(theirs.shapes) or not all(
        _splits_exactly(own, other, tp_local, tp_remote)
        for own, other in zip(mine.shapes, theirs.shapes, strict=True)
    ):
        return SplitProblem(name, local, remote, _state_hint(mine.kind))
    return None


_STATE_KIND_HINT = (
    "give both engines the same --mamba-ssm-cache-dtype, --mamba-cache-dtype and "
    "VLLM_SSM_CONV_STATE_LAYOUT (DS)"
)


def _state_hint(kind: str) -> str:
    why = (
        "vLLM replicates a Mamba2 model's B/C groups on each rank when n_groups is not "
        "divisible by TP"
        if kind == "mamba2"
        else "vLLM replicates a state on each rank when its heads do not divide over TP"
    )
    return (
        f"the {kind} state does not split evenly over both TP sizes ({why}, and NIXL would "
        "read it at the wrong offsets); use TP sizes that divide the model's state heads"
        + (" and n_groups" if kind == "mamba2" else "")
        + ", "
        + SAME_TP_HINT
    )


def _attention_problem(
    index: int,
    page_local: int,
    page_remote: int,
    kv_heads: int,
    tp_local: int,
    tp_remote: int,
) -> SplitProblem | None:
    heads_local, heads_remote = max(1, kv_heads // tp_local), max(1, kv_heads // tp_remote)
    if page_local * heads_remote != page_remote * heads_local:
        return SplitProblem(
            f"groups[{index}].page_bytes",
            page_local,
            page_remote,
            f"the per-rank pages are not {kv_heads} KV heads split over TP {tp_local} and "
            f"{tp_remote}; start both engines with the same model, --block-size and cache "
            f"dtype, {SAME_TP_HINT}",
        )
    return None


def split_problems(
    local_tp: int,
    remote_tp: int,
    *,
    local_role: str,
    transfer_mode: str,
    kv_heads: int,
    local_groups: list[dict[str, object]],
    remote_groups: list[dict[str, object]],
) -> list[SplitProblem]:
    """Problems of a hybrid pair whose TP sizes differ (``[]``: vLLM's NIXL can move its KV).

    ``local_role`` is ``"prefill"`` or ``"decode"``; groups are the fingerprints' group fields
    as dicts (``kind``, ``page_bytes``, ``state``)."""
    small, large = sorted((local_tp, remote_tp))
    if small < 1 or large % small:
        return [
            SplitProblem(
                "tensor_parallel_size",
                local_tp,
                remote_tp,
                "vLLM's NIXL moves KV between TP sizes that divide each other (1 and 2, 2 and "
                f"4, ...); {SAME_TP_HINT.removeprefix('or ')}",
            )
        ]
    if transfer_mode != "pull":
        return [
            SplitProblem(
                "tensor_parallel_size",
                local_tp,
                remote_tp,
                "HybridNixlPushConnector moves a hybrid model's KV only between equal TP sizes "
                "(vLLM's push worker); run HybridNixlConnector (pull) on both engines, "
                + SAME_TP_HINT,
            )
        ]
    prefill_tp, decode_tp = (
        (local_tp, remote_tp) if local_role == "prefill" else (remote_tp, local_tp)
    )
    if prefill_tp > decode_tp:
        return [
            SplitProblem(
                "tensor_parallel_size",
                local_tp,
                remote_tp,
                f"a hybrid model's KV from prefill TP {prefill_tp} into a smaller decode TP "
                f"{decode_tp} is not served (stock vLLM 0.32's TP 1 decode engine died reading "
                "a TP 2 prefill's hybrid KV, NIXL_ERR_BACKEND); run the decode engine at a TP "
                "at least the prefill's (a multiple of it), " + SAME_TP_HINT,
            )
        ]
    found: list[SplitProblem] = []
    # With Mamba groups, vLLM pads the attention pages to the state's page (a padding that
    # does not scale with TP); the model-level fields (heads, head size, dtypes, block size)
    # are compared as they are, and vLLM's NIXL reads each remote page by its own length.
    padded = any(group.get("kind") == "mamba" for group in (*local_groups, *remote_groups))
    for index, (mine, theirs) in enumerate(zip(local_groups, remote_groups, strict=False)):
        if mine.get("kind") != theirs.get("kind") or (padded and mine.get("kind") != "mamba"):
            continue  # a kind difference is named by the field comparison
        if mine.get("kind") == "mamba":
            problem = _state_problem(
                index, str(mine.get("state")), str(theirs.get("state")), local_tp, remote_tp
            )
        else:
            problem = _attention_problem(
                index,
                int(mine.get("page_bytes") or 0),
                int(theirs.get("page_bytes") or 0),
                kv_heads,
                local_tp,
                remote_tp,
            )
        if problem is not None:
            found.append(problem)
    return found


def read_part(
    is_state: bool, decode_tp: int, prefill_tp: int, decode_rank: int, total_kv_heads: int
) -> tuple[int, int] | str:
    """Which part of each prefill page decode rank ``decode_rank`` reads, as vLLM's NIXL
    worker (0.32) cuts it: ``(ratio, part)``, ``(1, 0)`` for the whole page, or why the part
    is not known. A state group (Mamba / linear attention) splits by the TP ratio; an
    attention group by the prefill's KV heads per rank over the decode's (a head a larger
    decode TP replicates is read whole). ``total_kv_heads`` as vLLM's transfer topology
    counts them: 1 for MLA, whose latent every rank holds whole."""
    if decode_tp < 1 or prefill_tp < 1:
        return f"TP sizes {prefill_tp} and {decode_tp} are not both at least 1"
    if decode_tp < prefill_tp:
        return (
            f"the prefill TP ({prefill_tp}) is larger than the decode TP ({decode_tp}): a "
            "decode page joins parts of several prefill pages"
        )
    if decode_tp % prefill_tp:
        return f"TP sizes {prefill_tp} and {decode_tp} do not divide"
    tp_ratio = decode_tp // prefill_tp
    if is_state:
        return tp_ratio, decode_rank % tp_ratio
    if total_kv_heads < 1:
        return "the model's KV head count is not known"
    prefill_heads = max(1, total_kv_heads // prefill_tp)
    decode_heads = max(1, total_kv_heads // decode_tp)
    if prefill_heads % decode_heads:
        return f"{prefill_heads} KV heads a prefill rank do not split into {decode_heads}"
    ratio = prefill_heads // decode_heads
    if ratio == 1:
        return 1, 0
    if decode_tp > total_kv_heads:  # several decode ranks hold each head
        source_rank = decode_rank * prefill_tp // decode_tp
        part = (
            decode_rank * total_kv_heads // decode_tp - source_rank * total_kv_heads // prefill_tp
        )
    else:
        part = decode_rank % tp_ratio
    if not 0 <= part < ratio:
        return f"decode rank {decode_rank} falls outside its prefill rank's {ratio} parts"
    return ratio, part
