"""After vLLM registers the KV caches, check what its descriptors will actually move.

For every KV-cache (transfer) group and a spread of logical blocks (the first, the last
and some between), the (address, length) descriptors vLLM's own NIXL worker computes for
that block must cover every byte the layout check assigned to the block in every layer of
the group, and nothing outside block ``b`` of the registered layers (a group that vLLM padded
to the others' layer count also reads block ``b`` of the slots it has no layer in: harmless,
that block belongs to this group only while it is this group's). Any difference refuses the
engine at start-up, naming the layer, group, block and bytes.

Not audited: host-buffer staging (``kv_buffer_device`` cpu on a GPU), where vLLM registers
copies of the caches rather than the caches themselves (logged as such).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hybrid_nixl.connector import compat
from vllm_hybrid_nixl.protocol.block_bytes import (
    ByteRange,
    block_ranges,
    merge_ranges,
    range_text,
    subtract_ranges,
)
from vllm_hybrid_nixl.protocol.layout import HybridLayoutError, ValidatedLayer

#: Logical blocks checked per group besides the first and the last.
SPREAD = 6


class RegistrationAuditError(HybridLayoutError):
    """vLLM's descriptors for a block are not the bytes the layout check assigned to it."""


@dataclass(frozen=True)
class AuditSummary:
    """What the audit verified: groups, blocks per group and descriptors compared."""

    groups: int
    blocks: tuple[int, ...]
    descriptors: int

    def text(self) -> str:
        return (
            f"{self.descriptors} NIXL descriptors of {self.groups} KV-cache groups, logical "
            f"blocks {', '.join(str(b) for b in self.blocks)}"
        )


def sample_blocks(num_blocks: int) -> tuple[int, ...]:
    """The first and last logical block and :data:`SPREAD` evenly spread between them."""
    picks = {0, num_blocks - 1}
    picks.update(num_blocks * step // (SPREAD + 1) for step in range(1, SPREAD + 1))
    return tuple(sorted(block for block in picks if 0 <= block < num_blocks))


def audit_registration(worker: Any, validated: list[ValidatedLayer]) -> AuditSummary:
    """Compare vLLM's descriptors with the validated layout; raise on the first difference.

    Raises :class:`RegistrationAuditError` on a difference, and also when this release's
    worker lacks a fact the audit reads or its descriptor computation fails (nothing
    verified is nothing to trust).
    """
    by_group: dict[int, list[ValidatedLayer]] = {}
    for item in validated:
        by_group.setdefault(item.layer.group_id, []).append(item)
    if not by_group:
        return AuditSummary(0, (), 0)
    num_groups = 1 + max(by_group)
    blocks = sample_blocks(validated[0].layer.num_blocks)
    compared = 0
    try:
        descriptors = compat.block_descriptor_query(worker)
        for block in blocks:
            of_layer = {id(item): block_ranges(item, block) for item in validated}
            anywhere = merge_ranges(r for ranges in of_layer.values() for r in ranges)
            for group_id in sorted(by_group):
                members = by_group[group_id]
                request = [[block] if g == group_id else [] for g in range(num_groups)]
                rows = descriptors(request)
                compared += len(rows)
                registered = merge_ranges(
                    zip(rows[:, 0].tolist(), (rows[:, 0] + rows[:, 1]).tolist(), strict=True)
                )
                expected = merge_ranges(r for item in members for r in of_layer[id(item)])
                missing = subtract_ranges(expected, registered)
                stray = subtract_ranges(registered, anywhere)
                if missing or stray:
                    raise RegistrationAuditError(
                        _mismatch_message(members, group_id, block, missing, stray)
                    )
    except RegistrationAuditError:
        raise
    except Exception as exc:  # a release whose descriptor computation we cannot follow
        raise RegistrationAuditError(_missing_message(exc)) from exc
    return AuditSummary(len(by_group), blocks, compared)


def _owner(members: list[ValidatedLayer], point: int, block: int) -> str:
    """The layer whose block ``block`` holds byte ``point`` (the group's first otherwise)."""
    for item in members:
        if any(start <= point < end for start, end in block_ranges(item, block)):
            return item.layer.name
    return members[0].layer.name


def _mismatch_message(
    members: list[ValidatedLayer],
    group_id: int,
    block: int,
    missing: list[ByteRange],
    stray: list[ByteRange],
) -> str:
    if missing:
        layer = _owner(members, missing[0][0], block)
        what = f"bytes {range_text(missing[0])} of the block are in no descriptor"
    else:
        layer = members[0].layer.name
        what = f"descriptor bytes {range_text(stray[0])} lie outside block {block} of every layer"
    spec = members[0].layer.spec_type
    release = compat.installed_release_text()
    return (
        f"registration audit: for logical block {block} of KV-cache group {group_id} "
        f"({spec}), layer '{layer}', the NIXL descriptors {release} computed are not the "
        f"bytes of that block: {what} ({sum(e - s for s, e in missing)} bytes missing, "
        f"{sum(e - s for s, e in stray)} bytes elsewhere). A read of this block would move "
        "other bytes (wrong tokens, silently). What to change: run a tested vLLM release "
        f"({compat.tested_releases_text()}), and report this model, its KV-cache layout and "
        "vLLM release to vllm-hybrid-nixl."
    )


def _missing_message(exc: Exception) -> str:
    return (
        f"registration audit on {compat.installed_release_text()}: {type(exc).__name__}: "
        f"{exc}. Without it nothing shows which bytes NIXL moves for a block, so this engine "
        "is refused. What to change: run a tested vLLM release "
        f"({compat.tested_releases_text()}) or a vllm-hybrid-nixl release made for yours."
    )
