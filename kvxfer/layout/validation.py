"""Validation of a :class:`~kvxfer.layout.model.KVCacheLayout`'s fields and of their combinations.

Each check raises :class:`LayoutError` naming the field that is off. ``KVCacheLayout.__post_init__``
calls them in order, between the steps that normalize fields: the later checks read derived sizes
(``page_bytes``, ``stride_order``), so they run once the fields they depend on are known to be sane."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer.errors import LayoutError
from kvxfer.layout.geometry import natural_block_bytes
from kvxfer.layout.kinds import NVFP4_GROUP, QUANTIZED_DTYPES, CacheKind, DType, Order, Packing

if TYPE_CHECKING:
    # Annotations only: the layout imports this module to check itself.
    from kvxfer.layout.model import KVCacheLayout

__all__ = ["check_block_bytes", "check_flags", "check_geometry", "check_kind", "check_numbers"]


def check_numbers(layout: KVCacheLayout) -> None:
    """The counts are positive integers, the sizes and strides that may be 0 (the default) integers >= 0."""
    for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name}: must be a positive integer, got {value!r}", field=name)
    for name in ("total_kv_heads", "head_size_v", "page_stride", "kernel_block_size", "block_bytes"):
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LayoutError(f"{name}: must be an integer >= 0, got {value!r}", field=name)


def check_flags(layout: KVCacheLayout) -> None:
    """The flags are bools (not merely truthy)."""
    for name in ("cross_layer", "heads_outer", "replicated"):
        if not isinstance(getattr(layout, name), bool):
            raise LayoutError(f"{name}: must be a bool, got {getattr(layout, name)!r}", field=name)


def check_kind(layout: KVCacheLayout) -> None:
    """heads_outer's order, then what the kind allows: heads, dtype, block size, head_size_v, nvfp4's head size
    and order, packing."""
    kind, dtype = layout.kind, layout.dtype
    # First: the messages below name the stride order, which only these combinations have.
    if layout.heads_outer and layout.order is not Order.HND:
        raise LayoutError("heads_outer: only the HND orders put heads outside the blocks (LHBNC, BHLNC)",
                          field="heads_outer")  # fmt: skip
    if kind in (CacheKind.MLA, CacheKind.MAMBA):
        if layout.num_kv_heads != 1 or layout.total_kv_heads != 1:
            raise LayoutError(
                f"num_kv_heads: a {kind} cache has one head per block, got num_kv_heads={layout.num_kv_heads}, "
                f"total_kv_heads={layout.total_kv_heads}",
                field="num_kv_heads",
            )
        if layout.head_size_v:
            raise LayoutError(f"head_size_v: a {kind} cache has no separate V, got {layout.head_size_v}",
                              field="head_size_v")  # fmt: skip
    if kind is CacheKind.MAMBA:
        if dtype is not DType.INT8:
            raise LayoutError(f"dtype: a mamba page tensor is int8, got {dtype}", field="dtype")
        if layout.block_size != 1:
            raise LayoutError(
                f"block_size: a mamba page has no token axis; use block_size=1, got {layout.block_size}",
                field="block_size",
            )
    if kind is CacheKind.QUANTIZED and dtype not in QUANTIZED_DTYPES:
        allowed = ", ".join(sorted(d.value for d in QUANTIZED_DTYPES))
        raise LayoutError(f"dtype: a quantized head-group cache holds {allowed}, got {dtype}", field="dtype")
    if kind in (CacheKind.QUANTIZED, CacheKind.KV_PLANES) and layout.head_size_v:
        raise LayoutError(
            f"head_size_v: {kind} caches keep K and V of one size (vLLM asserts it), got head_size "
            f"{layout.head_size}, head_size_v {layout.head_size_v}",
            field="head_size_v",
        )
    if dtype is DType.NVFP4:
        if kind is not CacheKind.QUANTIZED:
            raise LayoutError(
                f"dtype: nvfp4 is only defined for quantized head-group caches, not {kind}", field="dtype"
            )
        if layout.head_size % NVFP4_GROUP:
            raise LayoutError(
                f"head_size: nvfp4 needs a multiple of {NVFP4_GROUP}, got {layout.head_size}",
                field="head_size",
            )
        if layout.heads_outer:
            raise LayoutError(
                f"order: nvfp4 keeps each side's data rows and then its scale rows inside a page (LBHNC, LBNHC, "
                f"BLHNC or BLNHC); {layout.stride_order} does not describe where they are",
                field="order",
            )
    if layout.num_kv_heads > layout.total_kv_heads:
        raise LayoutError(
            f"num_kv_heads: {layout.num_kv_heads} local heads exceed total_kv_heads={layout.total_kv_heads}",
            field="num_kv_heads",
        )
    if layout.packing is not Packing.KV:
        if kind is not CacheKind.ATTENTION:
            raise LayoutError(f"packing: {layout.packing} describes attention pages, not {kind}", field="packing")
        if layout.order is not Order.HND:
            raise LayoutError(f"packing: {layout.packing} keeps each head's block together (an HND order), got "
                              f"{layout.stride_order}", field="packing")  # fmt: skip


def check_geometry(layout: KVCacheLayout) -> None:
    """Kernel blocks and padded pages fit the stride order and the page."""
    if layout.block_size % layout.tokens_per_kernel_block:
        raise LayoutError(
            f"kernel_block_size: {layout.kernel_block_size} does not divide block_size {layout.block_size}",
            field="kernel_block_size",
        )
    if layout.page_stride:
        if layout.page_stride < layout.page_bytes:
            raise LayoutError(
                f"page_stride: {layout.page_stride} bytes is less than a page of {layout.page_bytes} bytes",
                field="page_stride",
            )
        if layout.heads_outer or layout.kernel_block_size:
            raise LayoutError(
                "page_stride: padded pages must be whole blocks (vLLM pads only LBHNC/LBNHC/BLHNC/BLNHC pages "
                "that are not split into kernel blocks)",
                field="page_stride",
            )


def check_block_bytes(layout: KVCacheLayout) -> None:
    """A block's slack (``block_bytes``) only in a block-major region of whole blocks, at least its layers' pages."""
    if not layout.block_bytes:
        return
    if not layout.cross_layer:
        raise LayoutError(
            f"block_bytes: {layout.block_bytes} describes a block-major region (BLHNC, BLNHC, BHLNC); a region per "
            f"layer ({layout.stride_order}) has no block of all layers",
            field="block_bytes",
        )
    if layout.kernel_block_size:
        raise LayoutError("block_bytes: a block-major region of kernel blocks has no slack between blocks "
                          "(vLLM does not split block-major blocks)", field="block_bytes")  # fmt: skip
    if layout.block_bytes < natural_block_bytes(layout):
        raise LayoutError(
            f"block_bytes: {layout.block_bytes} is less than the {layout.num_layers} layers' pages of a block "
            f"({natural_block_bytes(layout)} bytes)",
            field="block_bytes",
        )
