"""A digest of exactly the bytes NIXL moves for each kernel page of a KV-cache group.

For every validated layer, :func:`page_geometry` turns the layout check's view of one logical
block (:func:`~vllm_hybrid_nixl.protocol.block_bytes.block_ranges`, the bytes the registration
audit proved vLLM's descriptors cover) into a per-kernel-page geometry: where page ``k``
starts in the layer's storage, and which pieces of it are moved (K and V halves for a
K/V-leading cache, the state bytes without padding for Mamba). :class:`PageDigester` hashes
those pieces for a list of kernel page ids per group with torch ops on the cache's own device
(no host copy on a GPU): the pieces of all pages of one layer are gathered in one
``index_select``, read as 64-bit words, and folded into two 64-bit lanes

    lane_a = sum(w_i * x_i),   lane_b = sum(v_i * (x_i ^ (x_i >> 29)))   (mod 2**64)

with fixed odd weights per word position (the same on every host and device). Integer
arithmetic wraps identically on CPU and CUDA, so both give the same digest. An odd weight is
invertible mod 2**64, so a change of any single word always changes lane_a; a page holding
another prompt's KV differs in many words and collides with probability about 2**-128. It is
a check against wrong or damaged bytes, not a cryptographic MAC.

Reads by a decode engine of a larger tensor-parallel size move a slice of each page: part
``j`` of ``r`` of every *region* of a piece (a K or V half holds one region, its heads; a Mamba
state holds its conv sub-projections and its temporal state). Both lanes are sums over word
positions, so a prefill worker whose group has a :class:`CellPlan` keeps them per *cell* (each
region cut into ``cells`` equal parts, weights still those of the whole piece): the cells add
up to the page digest, and cells ``j*cells/r .. (j+1)*cells/r`` of every region add up to what
decode rank part ``j`` received, which that rank digests with the same weights
(:meth:`PageDigester.digest_mapped`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_hybrid_nixl.protocol.block_bytes import block_ranges
from vllm_hybrid_nixl.protocol.layout import MAMBA_KIND, ValidatedLayer

WORD_BYTES = 8
MIX_SHIFT = 29
#: The most cells a region is cut into: reads by a decode rank holding up to this many times
#: fewer KV heads (or state parts) than a prefill rank can be verified. A prefill keeps 16
#: bytes a cell until the decode's read is checked (an attention page of vLLM's CPU cache:
#: one region, 64 bytes; a Mamba2 state page: four regions, 256 bytes).
MAX_CELLS = 4
_MASK64 = (1 << 64) - 1


class DigestGeometryError(ValueError):
    """A layer whose moved bytes are not the same pieces in every kernel page."""


@dataclass(frozen=True)
class PageGeometry:
    """Kernel page ``k`` of a layer moves ``pieces`` (offset in the page, length) of the
    bytes from ``base + k * stride`` of the layer's storage."""

    base: int
    stride: int
    pages: int
    pieces: tuple[tuple[int, int], ...]


def page_geometry(item: ValidatedLayer) -> PageGeometry:
    """The per-kernel-page geometry of a validated layer (raises
    :class:`DigestGeometryError` when block 0 and block 1 disagree)."""
    layer = item.layer
    ratio = 1 if layer.spec_kind == MAMBA_KIND else layer.ratio
    first = block_ranges(item, 0)
    if not first or len(first) % ratio:
        raise DigestGeometryError(f"layer '{layer.name}': {len(first)} byte ranges per block")
    per_page = len(first) // ratio
    start = first[0][0]
    pieces = tuple((s - start, e - s) for s, e in first[:per_page])
    if ratio > 1:
        stride = first[per_page][0] - start
    elif layer.num_blocks > 1:
        stride = block_ranges(item, 1)[0][0] - start
    else:
        stride = item.block_stride or layer.page_size
    pages = layer.num_blocks * ratio
    geometry = PageGeometry(start - layer.storage_ptr, stride, pages, pieces)
    if layer.num_blocks > 1:
        expected = [
            (layer.storage_ptr + geometry.base + page * stride + off, length)
            for page in range(ratio, 2 * ratio)
            for off, length in pieces
        ]
        if [(s, e - s) for s, e in block_ranges(item, 1)] != expected:
            raise DigestGeometryError(
                f"layer '{layer.name}': block 1's bytes are not block 0's moved by one stride"
            )
    last = geometry.base + (pages - 1) * stride + max(off + n for off, n in pieces)
    if last > layer.storage_nbytes:
        raise DigestGeometryError(f"layer '{layer.name}': pages run past the storage")
    return geometry


Region = tuple[int, int]  # (start, length) in bytes within a piece


@dataclass(frozen=True)
class CellPlan:
    """How every kernel page of a group is cut for reads by a larger decode TP: per piece,
    its regions (contiguous, covering the piece from byte 0), each cut into ``cells``
    equal, 8-byte-aligned parts."""

    regions: tuple[tuple[Region, ...], ...]
    cells: int

    @property
    def region_count(self) -> int:
        return sum(len(piece) for piece in self.regions)


def plan_cells(regions: Sequence[Sequence[Region]], limit: int = MAX_CELLS) -> CellPlan | None:
    """The finest power-of-two cut (at most ``limit`` cells a region) that keeps every cell
    word-aligned; None when the regions do not tile their pieces from byte 0 or a region is
    not whole words (one cell a region: only reads of whole pages can be answered)."""
    cells = limit
    lengths = [length for piece in regions for _, length in piece]
    for piece in regions:
        cursor = 0
        for start, length in piece:
            if start != cursor or length <= 0:
                return None
            cursor += length
    while cells > 1 and any(length % (WORD_BYTES * cells) for length in lengths):
        cells //= 2
    if not lengths or any(length % WORD_BYTES for length in lengths):
        return None
    return CellPlan(tuple(tuple(piece) for piece in regions), cells)


def _splitmix64(indices: np.ndarray, seed: int) -> np.ndarray:
    """Deterministic pseudo-random 64-bit values for ``indices`` (SplitMix64)."""
    with np.errstate(over="ignore"):
        z = indices.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)  # odd: invertible mod 2**64


def word_weights(words: int, lane: int) -> np.ndarray:
    """The odd weights of lane ``lane`` for word positions ``0..words-1`` (as int64)."""
    return _splitmix64(np.arange(words), 0x5EED0000 + lane).view(np.int64)


def piece_multiplier(layer_index: int, piece: int) -> int:
    """An odd 64-bit multiplier (as a signed int) that keeps pieces of different layers apart."""
    value = int(_splitmix64(np.array([layer_index * 64 + piece]), 0xC0FFEE)[0])
    return value - (1 << 64) if value >= 1 << 63 else value


def _mixed(words: torch.Tensor) -> torch.Tensor:
    """``x ^ (x >> 29)`` (arithmetic shift of signed words): lane b's nonlinear input."""
    mixed = torch.bitwise_right_shift(words, MIX_SHIFT)
    return mixed.bitwise_xor_(words)


@dataclass
class _Layer:
    storage: torch.Tensor  # the layer's whole storage as uint8
    geometry: PageGeometry
    index: int  # its place among the group's layers (the same on both engines)
    words: torch.Tensor | None = None  # the storage as int64 words, made on first use


class PageDigester:
    """Digests of kernel pages per KV-cache group, over every layer of the group."""

    def __init__(
        self,
        layers: Sequence[tuple[int, torch.Tensor, ValidatedLayer]],
        plans: Mapping[int, CellPlan] | None = None,
    ) -> None:
        """``layers``: (transfer group, the layer's cache tensor, its validated layer);
        ``plans``: the cell plan of groups that can serve or check split reads (kept for a
        group only where every layer's pieces have the plan's lengths)."""
        self._groups: dict[int, list[_Layer]] = {}
        self._weights: dict[tuple[str, int, int], torch.Tensor] = {}
        for group, cache, item in layers:
            storage = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
                cache.untyped_storage()
            )
            members = self._groups.setdefault(group, [])
            members.append(_Layer(storage, page_geometry(item), len(members)))
        self._plans = {
            group: plan
            for group, plan in (plans or {}).items()
            if self._groups.get(group)
            and all(_plan_fits(plan, entry.geometry) for entry in self._groups[group])
        }

    @property
    def groups(self) -> list[int]:
        return sorted(self._groups)

    def plan(self, group: int) -> CellPlan | None:
        """The cell plan this group's pages are digested with (None: whole pages only)."""
        return self._plans.get(group)

    def _lane_weights(self, device: torch.device, words: int, lane: int) -> torch.Tensor:
        key = (str(device), words, lane)
        weights = self._weights.get(key)
        if weights is None:
            weights = torch.from_numpy(word_weights(words, lane)).to(device)
            self._weights[key] = weights
        return weights

    def _members(self, group: int, pages: Sequence[int]) -> list[_Layer]:
        layers = self._groups.get(group)
        if layers is None:
            raise KeyError(f"no KV-cache group {group} on this worker")
        for entry in layers:
            if pages and (min(pages) < 0 or max(pages) >= entry.geometry.pages):
                raise IndexError(f"kernel page out of range 0..{entry.geometry.pages - 1}: {pages}")
        return layers

    def _terms(self, words: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Both lanes' weighted words (weights of word positions ``first..``)."""
        count = words.shape[1]
        device = words.device
        lane_a = words * self._lane_weights(device, first + count, 0)[first:]
        lane_b = _mixed(words).mul_(self._lane_weights(device, first + count, 1)[first:])
        return lane_a, lane_b

    def digest(self, group: int, pages: Sequence[int]) -> np.ndarray:
        """``[len(pages), 2]`` uint64 lanes for kernel pages ``pages`` of ``group``."""
        return self.digest_cells(group, pages, with_cells=False)[0]

    def digest_cells(
        self, group: int, pages: Sequence[int], with_cells: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The page lanes and, for a group with a cell plan (and ``with_cells``),
        ``[len(pages), regions, cells, 2]`` uint64 cell lanes that add up to them."""
        layers = self._members(group, pages)
        plan = self._plans.get(group) if with_cells else None
        if not pages:
            shape = None if plan is None else (0, plan.region_count, plan.cells, 2)
            empty_cells = None if shape is None else np.zeros(shape, dtype=np.uint64)
            return np.zeros((0, 2), dtype=np.uint64), empty_cells
        total: torch.Tensor | None = None
        for entry in layers:
            index = torch.tensor(list(pages), dtype=torch.int64, device=entry.storage.device)
            parts: list[torch.Tensor] = []
            for piece, (offset, length) in enumerate(entry.geometry.pieces):
                lane_a, lane_b = self._terms(_gathered_words(entry, offset, length, index))
                multiplier = piece_multiplier(entry.index, piece)
                if plan is None:
                    parts.append(torch.stack((lane_a.sum(dim=1), lane_b.sum(dim=1)), dim=1))
                else:
                    regions = plan.regions[piece]
                    parts.append(
                        torch.stack(
                            (
                                _cell_sums(lane_a, regions, plan.cells),
                                _cell_sums(lane_b, regions, plan.cells),
                            ),
                            dim=-1,
                        )
                    )
                parts[-1] = parts[-1] * multiplier
            layer_lanes = sum(parts[1:], parts[0]) if plan is None else torch.cat(parts, dim=1)
            total = layer_lanes if total is None else total + layer_lanes
        assert total is not None  # a group has at least one layer
        if plan is None:
            return total.cpu().numpy().view(np.uint64), None
        cells = total.cpu().numpy().view(np.uint64)
        with np.errstate(over="ignore"):
            lanes = cells.sum(axis=(1, 2), dtype=np.uint64)
        return lanes, cells

    def digest_mapped(self, group: int, pages: Sequence[int], ratio: int, part: int) -> np.ndarray:
        """``[len(pages), 2]`` lanes of this worker's pages read as part ``part`` of
        ``ratio`` of a larger remote page: each local region digested with the weights of
        the place it came from (region start x ``ratio`` + ``part`` x its length), so they
        equal the remote cells of that part (``digest_wire.part_of_cells``)."""
        layers = self._members(group, pages)
        plan = self._plans.get(group)
        if plan is None:
            raise KeyError(f"KV-cache group {group} has no cell plan on this worker")
        if not pages:
            return np.zeros((0, 2), dtype=np.uint64)
        total: torch.Tensor | None = None
        for entry in layers:
            index = torch.tensor(list(pages), dtype=torch.int64, device=entry.storage.device)
            for piece, (offset, _) in enumerate(entry.geometry.pieces):
                multiplier = piece_multiplier(entry.index, piece)
                for start, length in plan.regions[piece]:
                    words = _gathered_words(entry, offset + start, length, index)
                    first = (ratio * start + part * length) // WORD_BYTES
                    lane_a, lane_b = self._terms(words, first)
                    lanes = torch.stack((lane_a.sum(dim=1), lane_b.sum(dim=1)), dim=1)
                    lanes = lanes * multiplier
                    total = lanes if total is None else total + lanes
        assert total is not None
        return total.cpu().numpy().view(np.uint64)


def _plan_fits(plan: CellPlan, geometry: PageGeometry) -> bool:
    """The plan's regions tile exactly this geometry's pieces."""
    return len(plan.regions) == len(geometry.pieces) and all(
        sum(length for _, length in regions) == piece_length
        for regions, (_, piece_length) in zip(plan.regions, geometry.pieces, strict=True)
    )


def _cell_sums(terms: torch.Tensor, regions: Sequence[Region], cells: int) -> torch.Tensor:
    """``[n, len(regions), cells]`` sums of ``[n, words]`` weighted words, cell by cell."""
    rows = terms.shape[0]
    sums = []
    for start, length in regions:
        first, count = start // WORD_BYTES, length // WORD_BYTES
        sums.append(terms[:, first : first + count].reshape(rows, cells, -1).sum(dim=-1))
    return torch.stack(sums, dim=1)


def _gathered_words(entry: _Layer, offset: int, length: int, index: torch.Tensor) -> torch.Tensor:
    """``[len(index), ceil(length / 8)]`` int64 words of one piece of the given pages (zero
    padded); gathered as 64-bit words when the piece is 8-byte aligned, as bytes otherwise."""
    geometry = entry.geometry
    start = geometry.base + offset
    if start % WORD_BYTES == 0 and geometry.stride % WORD_BYTES == 0 and length % WORD_BYTES == 0:
        if entry.words is None:
            usable = entry.storage.numel() // WORD_BYTES * WORD_BYTES
            entry.words = entry.storage[:usable].view(torch.int64)
        return entry.words.as_strided(
            (geometry.pages, length // WORD_BYTES),
            (geometry.stride // WORD_BYTES, 1),
            start // WORD_BYTES,
        ).index_select(0, index)
    rows = entry.storage.as_strided((geometry.pages, length), (geometry.stride, 1), start)
    rows = rows.index_select(0, index)
    pad = -length % WORD_BYTES
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(torch.int64)


def reference_digest(page_bytes: Sequence[Sequence[bytes]]) -> tuple[int, int]:
    """The same digest for one kernel page, in plain Python integers: ``page_bytes[layer]``
    lists the moved pieces of that layer (used by tests to check the torch path)."""
    lane_a = lane_b = 0
    for layer_index, pieces in enumerate(page_bytes):
        for piece, data in enumerate(pieces):
            padded = bytes(data) + b"\0" * (-len(data) % WORD_BYTES)
            words = np.frombuffer(padded, dtype=np.uint64)
            wa = word_weights(len(words), 0).view(np.uint64)
            wb = word_weights(len(words), 1).view(np.uint64)
            a = sum(int(w) * int(x) for w, x in zip(wa, words, strict=True)) & _MASK64
            signed = words.view(np.int64)
            mixed = [(int(x) ^ (int(x) >> MIX_SHIFT)) & _MASK64 for x in signed]
            b = sum(int(w) * x for w, x in zip(wb, mixed, strict=True)) & _MASK64
            mult = piece_multiplier(layer_index, piece) & _MASK64
            lane_a = (lane_a + a * mult) & _MASK64
            lane_b = (lane_b + b * mult) & _MASK64
    return lane_a, lane_b
