"""The HMA-aware KV-cache layout check: plain data in, verdicts out, no vLLM import.

vLLM's hybrid memory allocator (HMA) gives every KV-cache group the same number of
logical blocks ``NB`` and pads pages so that layers of different groups can share one
allocation.  When the attention kernel's block size is smaller than the user block
size, each logical block holds ``r`` physical (kernel) blocks.  The legal per-layer
views are then:

* attention (full, sliding window, chunked local, MLA):
  ``[NB, ...]`` with a page of ``PS`` bytes ("logical" form),
  ``[NB*r, ...]`` with a page of ``PS/r`` bytes ("physical" form),
  or a flat byte view of at least ``NB*PS`` bytes ("flat" form);
  or K/V-leading ``[2, NB*r, ...]``: two block-major halves (K, then V) of ``NB*r``
  blocks of ``PS/(2r)`` bytes each ("kv_split" form, e.g. ROCm attention);
* Mamba: ``[NB, ...]`` with one state of ``PS`` bytes per logical block, or flat.

:func:`check_layout` accepts exactly those and raises :class:`HybridLayoutError`
naming the layer, what was seen, what would have been accepted and what to change.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

ATTENTION_KINDS = frozenset({"full_attention", "sliding_window", "chunked_local", "mla"})
MAMBA_KIND = "mamba"


class LayoutForm(str, Enum):
    """How a layer's cache tensor addresses its blocks."""

    LOGICAL = "logical"  # [NB, ...], page PS bytes
    PHYSICAL = "physical"  # [NB*r, ...], page PS/r bytes
    FLAT = "flat"  # 1-D byte view, >= NB*PS bytes
    KV_SPLIT = "kv_split"  # [2, NB*r, ...]: K half then V half, pages of PS/(2r) bytes


class HybridLayoutError(ValueError):
    """A KV-cache tensor whose layout NIXL cannot transfer byte-correctly."""


@dataclass(frozen=True)
class LayerDescription:
    """What the check needs to know about one layer's cache tensor (plain data).

    ``shape`` and ``stride`` are in elements, as torch reports them; addresses and
    sizes are in bytes.
    """

    name: str
    spec_kind: str  # one of ATTENTION_KINDS, MAMBA_KIND, or anything else (rejected)
    spec_type: str  # the vLLM spec class name, for messages
    group_id: int
    num_blocks: int  # NB: logical blocks of the layer's group
    ratio: int  # r: physical blocks per logical block
    page_size: int  # PS: logical page size in bytes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_size: int
    dtype: str
    data_ptr: int
    storage_ptr: int
    storage_nbytes: int
    #: Mamba: bytes of state at the start of each page (the rest is HMA padding); 0 = the page
    state_bytes: int = 0


@dataclass(frozen=True)
class ValidatedLayer:
    """A layer that passed the check, with the form it was recognised in."""

    layer: LayerDescription
    form: LayoutForm
    block_stride: int  # bytes between consecutive blocks of the view (0 for flat)
    extent: int  # bytes NIXL will register from the view's first byte

    @property
    def physical_page_size(self) -> int:
        """Bytes of one physical (kernel) block for attention, one state for Mamba."""
        if self.layer.spec_kind == MAMBA_KIND:
            return self.layer.page_size
        return self.layer.page_size // self.layer.ratio

    @property
    def needs_physical_view(self) -> bool:
        """True when NIXL must be handed a ``[NB*r, PS/r]`` view of this tensor."""
        if self.layer.spec_kind == MAMBA_KIND:
            return self.form is LayoutForm.FLAT
        if self.form is LayoutForm.KV_SPLIT:
            return False  # registered as two regions by the base, as it is
        return self.form is LayoutForm.FLAT or (
            self.form is LayoutForm.LOGICAL and self.layer.ratio != 1
        )


def _inner_span(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int]:
    """Element count of one block (dims 1..) and the span its elements cover."""
    count = math.prod(shape[1:]) if len(shape) > 1 else 1
    if count == 0:
        return 0, 0
    span = sum((size - 1) * abs(step) for size, step in zip(shape[1:], stride[1:], strict=True)) + 1
    return count, span


def _byte_extent(layer: LayerDescription) -> int:
    """Bytes from the view's first element to one past its last element."""
    if any(size == 0 for size in layer.shape):
        return 0
    last = sum((size - 1) * abs(step) for size, step in zip(layer.shape, layer.stride, strict=True))
    return (last + 1) * layer.element_size


def _accepted_forms_text(layer: LayerDescription) -> str:
    nb, r, ps = layer.num_blocks, layer.ratio, layer.page_size
    if layer.spec_kind == MAMBA_KIND:
        return (
            f"[{nb}, ...] with one state of {ps} bytes per block (block stride {ps} bytes), "
            f"or a flat byte view of at least {nb * ps} bytes"
        )
    forms = [f"[{nb}, ...] with a dense page of {ps} bytes"]
    if r != 1:
        forms[0] += f" and block stride exactly {ps} bytes"
        forms.append(f"[{nb * r}, ...] with a dense page of {ps // r} bytes")
    forms.append(f"a flat byte view of at least {nb * ps} bytes")
    if ps % (2 * r) == 0:
        forms.append(
            f"K/V-leading [2, {nb * r}, ...] with two dense halves of {nb * r} blocks of "
            f"{ps // (2 * r)} bytes"
        )
    return "; ".join(forms)


def _error(layer: LayerDescription, problem: str, fix: str) -> HybridLayoutError:
    return HybridLayoutError(
        f"KV cache of layer '{layer.name}' cannot be registered with NIXL: {problem}. "
        f"Layer: spec={layer.spec_type} ({layer.spec_kind}), group={layer.group_id}, "
        f"NB={layer.num_blocks}, r={layer.ratio}, PS={layer.page_size} bytes; "
        f"tensor shape={tuple(layer.shape)}, stride={tuple(layer.stride)}, "
        f"dtype={layer.dtype}. Accepted forms: {_accepted_forms_text(layer)}. "
        f"What to change: {fix}"
    )


_FIX_ALLOCATION = (
    "allocate this layer's cache block-major as vLLM's hybrid allocator does "
    "(do not slice, transpose or re-pad the tensor vLLM allocated), or report the "
    "attention backend and vLLM version to vllm-hybrid-nixl if vLLM itself built it"
)


def _validate_block_major(
    layer: LayerDescription, blocks: int, page: int, exact_stride: bool
) -> tuple[int | None, str]:
    """Return (block_stride, '') when the view is ``[blocks, page bytes]``, else (None, why)."""
    if layer.shape[0] != blocks:
        return None, f"first dimension is {layer.shape[0]}, expected {blocks}"
    count, span = _inner_span(layer.shape, layer.stride)
    content = count * layer.element_size
    if span != count:
        return None, "the elements of one block are not dense in memory"
    block_stride = abs(layer.stride[0]) * layer.element_size
    if layer.stride[0] <= 0 and blocks > 1:
        return None, "the block dimension does not advance forward in memory"
    if exact_stride and block_stride != page:
        return None, f"block stride is {block_stride} bytes, expected exactly {page}"
    if content == page and block_stride >= page:
        return block_stride, ""
    if content < page and block_stride == page:  # padded page (HMA page padding)
        return block_stride, ""
    return None, (
        f"one block holds {content} bytes with a block stride of {block_stride} bytes, "
        f"expected a page of {page} bytes"
    )


def _validate_kv_split(layer: LayerDescription) -> tuple[int | None, str]:
    """``[2, NB*r, ...]``: each half block-major with pages of PS/(2r) bytes, halves apart."""
    nb, r, ps = layer.num_blocks, layer.ratio, layer.page_size
    if ps % (2 * r):
        return None, f"a page of {ps} bytes does not split into K and V halves of r={r} blocks"
    half = LayerDescription(
        **{**layer.__dict__, "shape": layer.shape[1:], "stride": layer.stride[1:]}
    )
    blocks, page = nb * r, ps // (2 * r)
    stride, why = _validate_block_major(half, blocks, page, exact_stride=True)
    if stride is None:
        return None, f"each half: {why}"
    half_bytes = blocks * page
    if layer.stride[0] * layer.element_size < half_bytes:
        return None, (
            f"the V half starts {layer.stride[0] * layer.element_size} bytes after the K half, "
            f"inside it (each half holds {half_bytes} bytes)"
        )
    return stride, ""


def _check_inside_storage(layer: LayerDescription, needed: int) -> None:
    if layer.data_ptr < layer.storage_ptr:
        raise _error(layer, "the view starts before its storage", _FIX_ALLOCATION)
    end = layer.data_ptr - layer.storage_ptr + needed
    if end > layer.storage_nbytes:
        raise _error(
            layer,
            f"the {needed} bytes NIXL would register end {end - layer.storage_nbytes} "
            f"bytes past the end of the tensor's storage ({layer.storage_nbytes} bytes)",
            _FIX_ALLOCATION,
        )


def validate_layer(layer: LayerDescription) -> ValidatedLayer:
    """Recognise the layer's form or raise :class:`HybridLayoutError`."""
    nb, r, ps = layer.num_blocks, layer.ratio, layer.page_size
    if layer.spec_kind not in ATTENTION_KINDS and layer.spec_kind != MAMBA_KIND:
        raise _error(
            layer,
            f"spec kind '{layer.spec_kind}' is not one vllm-hybrid-nixl can transfer",
            "serve this model without a NIXL connector, or ask for this cache kind to be supported",
        )
    if nb <= 0 or ps <= 0 or r <= 0:
        raise _error(layer, "NB, r and PS must all be positive", _FIX_ALLOCATION)
    if layer.spec_kind != MAMBA_KIND and ps % r != 0:
        raise _error(
            layer,
            f"the page of {ps} bytes does not split into r={r} kernel blocks",
            "choose a --block-size that is a multiple of the attention kernel's block size",
        )
    if not layer.shape:
        raise _error(layer, "the tensor is a scalar", _FIX_ALLOCATION)

    form: LayoutForm | None = None
    block_stride = 0
    reasons: list[str] = []
    if len(layer.shape) == 1:
        nbytes = layer.shape[0] * layer.element_size
        if layer.stride[0] != 1:
            reasons.append("flat view is not contiguous")
        elif nbytes < nb * ps:
            reasons.append(f"flat view holds {nbytes} bytes, fewer than NB*PS = {nb * ps}")
        else:
            form = LayoutForm.FLAT
    elif layer.spec_kind == MAMBA_KIND:
        stride, why = _validate_block_major(layer, nb, ps, exact_stride=True)
        if stride is None:
            reasons.append(f"as [NB, ...]: {why}")
        else:
            form, block_stride = LayoutForm.LOGICAL, stride
    else:
        candidates = [(LayoutForm.LOGICAL, nb, ps, r != 1)]
        if r != 1:
            candidates.append((LayoutForm.PHYSICAL, nb * r, ps // r, False))
        for candidate, blocks, page, exact in candidates:
            stride, why = _validate_block_major(layer, blocks, page, exact_stride=exact)
            if stride is not None:
                form, block_stride = candidate, stride
                break
            label = "[NB, ...]" if candidate is LayoutForm.LOGICAL else "[NB*r, ...]"
            reasons.append(f"as {label}: {why}")
        if form is None and layer.shape[0] == 2 and len(layer.shape) >= 3:
            stride, why = _validate_kv_split(layer)
            if stride is not None:
                form, block_stride = LayoutForm.KV_SPLIT, stride
            else:
                reasons.append(f"as K/V-leading [2, NB*r, ...]: {why}")
    if form is None:
        raise _error(layer, "; ".join(reasons), _FIX_ALLOCATION)

    needed = nb * ps if form is LayoutForm.FLAT else _byte_extent(layer)
    _check_inside_storage(layer, needed)
    return ValidatedLayer(layer=layer, form=form, block_stride=block_stride, extent=needed)


def _registered_range(item: ValidatedLayer) -> tuple[int, int]:
    return item.layer.data_ptr, item.layer.data_ptr + item.extent


def _check_shared_storage(validated: Sequence[ValidatedLayer]) -> None:
    """Layers whose bytes alias (HMA overlays groups) must address the same block grid.

    Layers that merely live side by side in one allocation (vLLM 0.32+ places every
    layer in one backing buffer) may differ; layers that overlap must agree on page
    size, block count and block alignment, or a block of one is a different block of
    the other and NIXL moves the wrong bytes.
    """
    by_storage: dict[int, list[ValidatedLayer]] = defaultdict(list)
    for item in validated:
        by_storage[item.layer.storage_ptr].append(item)
    for members in by_storage.values():
        ordered = sorted(members, key=lambda item: item.layer.data_ptr)
        open_layers: list[tuple[int, ValidatedLayer]] = []  # (end, layer) still overlapping
        for item in ordered:
            start, end = _registered_range(item)
            open_layers = [(e, other) for e, other in open_layers if e > start]
            for _, other in open_layers:
                _require_same_grid(item, other)
            open_layers.append((end, item))


def _require_same_grid(item: ValidatedLayer, other: ValidatedLayer) -> None:
    layer, first = item.layer, other.layer
    aligned = (layer.data_ptr - first.data_ptr) % other.physical_page_size == 0
    if (layer.page_size, layer.num_blocks) == (first.page_size, first.num_blocks) and aligned:
        return
    raise _error(
        layer,
        f"its bytes overlap those of layer '{first.name}' (spec={first.spec_type}, "
        f"group={first.group_id}, PS={first.page_size} bytes, NB={first.num_blocks}) in one "
        f"shared allocation, but it has PS={layer.page_size} bytes and NB={layer.num_blocks}"
        + (
            ""
            if aligned
            else f" and starts {layer.data_ptr - first.data_ptr} bytes away, "
            "not on a block boundary"
        )
        + "; layers that share storage must agree on page size and block count or NIXL "
        "transfers the wrong bytes",
        "let vLLM's hybrid allocator pad the pages of all groups to one size "
        "(do not override page sizes), or give these layers separate storage",
    )


def check_layout(layers: Iterable[LayerDescription]) -> list[ValidatedLayer]:
    """Validate every layer and the storage they share; raise on the first problem."""
    # Layers of one group usually have one geometry: recognise it once, bound-check each.
    known: dict[tuple[object, ...], ValidatedLayer] = {}
    validated = []
    for layer in layers:
        geometry = (
            layer.spec_kind,
            layer.num_blocks,
            layer.ratio,
            layer.page_size,
            layer.shape,
            layer.stride,
            layer.element_size,
        )
        prior = known.get(geometry)
        if prior is None:
            item = known[geometry] = validate_layer(layer)
        else:
            _check_inside_storage(layer, prior.extent)
            item = ValidatedLayer(layer, prior.form, prior.block_stride, prior.extent)
        validated.append(item)
    _check_shared_storage(validated)
    return validated
