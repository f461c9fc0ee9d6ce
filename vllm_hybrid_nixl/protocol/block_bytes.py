"""Which bytes one logical block of a validated layer occupies: plain data, no vLLM import.

The registration audit compares these with the (address, length) descriptors vLLM's NIXL
worker computes for the same block; both sides are merged into sorted, disjoint
half-open byte ranges before they are compared.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_hybrid_nixl.protocol.layout import MAMBA_KIND, LayoutForm, ValidatedLayer

ByteRange = tuple[int, int]  # [start, end)


def merge_ranges(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    """Sorted, disjoint ranges covering exactly the bytes of ``ranges`` (empty ones dropped)."""
    merged: list[ByteRange] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def block_ranges(item: ValidatedLayer, block: int) -> list[ByteRange]:
    """The bytes logical block ``block`` of this layer holds, as the layout check read them.

    Attention: the ``r`` kernel pages of the block (each ``PS/r`` bytes; for a K/V-leading
    cache the K and the V half of each). Mamba: the block's state bytes from the start of its
    page (``state_bytes`` of the layer, the whole page when unknown), the padding excluded.
    """
    layer = item.layer
    if layer.spec_kind == MAMBA_KIND:
        stride = item.block_stride or layer.page_size
        start = layer.data_ptr + block * stride
        return [(start, start + (layer.state_bytes or layer.page_size))]
    page = item.physical_page_size
    if item.form is LayoutForm.KV_SPLIT:
        half = page // 2
        v_offset = layer.stride[0] * layer.element_size
        ranges = []
        for kernel in range(block * layer.ratio, (block + 1) * layer.ratio):
            start = layer.data_ptr + kernel * item.block_stride
            ranges += [(start, start + half), (start + v_offset, start + v_offset + half)]
        return ranges
    if item.form is LayoutForm.PHYSICAL:
        kernel_stride = item.block_stride
    elif item.form is LayoutForm.FLAT:
        kernel_stride = page
    else:  # LOGICAL: r == 1, or r != 1 with a block stride of exactly PS
        kernel_stride = item.block_stride // layer.ratio
    first = layer.data_ptr + block * layer.ratio * kernel_stride
    return [
        (first + k * kernel_stride, first + k * kernel_stride + page) for k in range(layer.ratio)
    ]


def subtract_ranges(ranges: list[ByteRange], minus: list[ByteRange]) -> list[ByteRange]:
    """The parts of merged ``ranges`` that no range of merged ``minus`` covers (one sweep
    over both sorted lists)."""
    left: list[ByteRange] = []
    cut = 0
    for start, end in ranges:
        while cut < len(minus) and minus[cut][1] <= start:
            cut += 1
        cursor, index = start, cut
        while index < len(minus) and minus[index][0] < end:
            cut_start, cut_end = minus[index]
            if cut_start > cursor:
                left.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
            index += 1
        if cursor < end:
            left.append((cursor, end))
    return left


def range_text(byte_range: ByteRange) -> str:
    start, end = byte_range
    return f"0x{start:x}..0x{end:x} ({end - start} bytes)"
