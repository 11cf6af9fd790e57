"""Where a layout's bytes lie: the byte strides of its axes in each of vLLM's stride orders, and
the planes every row of a block is addressed through (:attr:`KVCacheLayout.planes`).

Functions of a validated layout; the layout caches what they return."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer.layout.kinds import NVFP4_GROUP, CacheKind, DType, Order, Packing
from kvxfer.layout.values import Plane

if TYPE_CHECKING:
    # Annotations only: the layout imports this module to compute its geometry.
    from kvxfer.layout.model import KVCacheLayout

__all__ = ["Strides", "byte_strides", "natural_block_bytes", "planes_of"]

#: Byte strides of (layer inside a region, kernel block, slot, token, manager block).
Strides = tuple[int, int, int, int, int]


def natural_block_bytes(layout: KVCacheLayout) -> int:
    """Bytes of one block of a block-major region without slack: its layers' (padded) pages."""
    page = layout.page_bytes if layout.heads_outer else layout.padded_page_bytes
    return layout.num_layers * page


def byte_strides(layout: KVCacheLayout) -> Strides:
    """Byte strides of (layer inside a region, kernel block, slot, token, manager block)."""
    nk, c, s = layout.tokens_per_kernel_block, layout.row_bytes, layout.slots
    layers, kblocks, r = (
        layout.num_layers,
        layout.num_blocks * layout.kernel_blocks_per_block,
        layout.kernel_blocks_per_block,
    )
    hnd = layout.order is Order.HND
    slot, tok = (nk * c, c) if hnd else (c, s * c)
    kpage = layout.padded_page_bytes // r  # a kernel page (r > 1 only without padding)
    if layout.heads_outer:
        if layout.cross_layer:  # BHLNC
            layer, slot = nk * c, layers * nk * c
            kblock = layout.block_bytes or s * layers * nk * c
        else:  # LHBNC
            layer, kblock, slot = 0, nk * c, kblocks * nk * c
    elif layout.cross_layer:  # BLHNC, BLNHC
        layer, kblock = kpage, layout.block_bytes or layers * kpage
    else:  # LBHNC, LBNHC
        layer, kblock = 0, kpage
    return layer, kblock, slot, tok, kblock * r


def planes_of(layout: KVCacheLayout, strides: Strides) -> tuple[Plane, ...]:
    """:attr:`KVCacheLayout.planes`: the rows of one block, plane by plane, given the layout's :func:`byte_strides`."""
    _, kblock, slot, tok, _ = strides
    c, h = layout.row_bytes, layout.num_kv_heads
    kind = layout.kind
    if kind is CacheKind.ATTENTION:
        if layout.packing is Packing.CPU_KT:
            # Per head: K as head_size rows of `tokens` elements (transposed), then V rows.
            nk, e = layout.tokens_per_kernel_block, layout.element_bytes
            return (
                Plane("k", 0, slot, e, kblock, e, layout.head_size, nk * e),
                Plane("v", nk * layout.head_size * e, slot, layout.v_head_size * e, kblock, layout.v_head_size * e),
            )
        return (Plane("kv", 0, slot, tok, kblock, c),)
    if kind in (CacheKind.MLA, CacheKind.MAMBA):
        return (Plane("latent" if kind is CacheKind.MLA else "state", 0, 0, tok, kblock, c),)
    if kind is CacheKind.KV_PLANES:
        head = layout.head_size * layout.element_bytes
        return tuple(Plane(part, i * slot, head, tok, kblock, head) for i, part in enumerate(("k", "v")))
    if layout.dtype is not DType.NVFP4:
        return tuple(Plane(part, i * h * slot, slot, tok, kblock, c) for i, part in enumerate(("k", "v")))
    # nvfp4 (FlashInfer's _nvfp4_kv_views): per side, the data of every (head, token) row, then every
    # row's scales, the rows in the page's order (HND: a head's tokens, NHD: a token's heads).
    nk, data, scale = layout.tokens_per_kernel_block, layout.head_size // 2, layout.head_size // NVFP4_GROUP
    hnd = layout.order is Order.HND
    out = []
    for i, side in enumerate(("k", "v")):
        start = i * h * nk * c
        for part, offset, n in (("data", start, data), ("scale", start + h * nk * data, scale)):
            head, token = (nk * n, n) if hnd else (n, h * n)
            out.append(Plane(f"{side}_{part}", offset, head, token, kblock, n))
    return tuple(out)
