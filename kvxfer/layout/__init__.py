"""Standardized KV-cache layouts: a frozen, validated description of one cache group.

A *cache group* is a set of layers whose caches share one shape: every full-attention layer of a
model, its sliding-window layers, or its Mamba layers. Every cache is blocks-first and reaches a
connector as a 4-D ``[B, H, N, C]`` view per layer: ``B`` blocks, ``H`` *slots* on the head axis,
``N`` tokens per block, ``C`` content bytes per (slot, token) cell. What a slot and its content
hold depends on the kind:

============  =======================  ==========================================================
kind          slots (H)                content of one (slot, token) cell
============  =======================  ==========================================================
attention     one per KV head          K then V of that head (``head_size + head_size_v``
                                       elements): bf16/fp16/fp32 and fp8 (e4m3/e5m2) alike
quantized     2 x KV heads (K, then V) K or V of one head: fp8/int8 codes, or nvfp4 (see below)
kv_planes     2 (a K plane, a V plane) K or V of *every* head of the rank, head after head
mla           1                        the latent of one token (``kv_lora_rank + rope_dim``)
mamba         1 (one token)            the whole state page of one block (bytes; see TP below)
============  =======================  ==========================================================

Physical order. Within one layer the axes are laid out in one of vLLM's stride orders over the
logical ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``):

* ``order`` HND or NHD: whether a slot's tokens (HND) or a token's slots (NHD) are contiguous;
* ``cross_layer``: one block-major region holds every layer (a block holds all layers' pages);
* ``heads_outer``: the head axis lies outside the blocks (LHBNC) or outside the layers (BHLNC).

LBHNC = HND, LBNHC = NHD, LHBNC = HND + heads_outer, BLHNC = HND + cross_layer, BLNHC = NHD +
cross_layer, BHLNC = HND + cross_layer + heads_outer. A page may be padded (``page_stride`` >
``page_bytes``), and vLLM may split a block of ``block_size`` tokens into ``block_size //
kernel_block_size`` kernel blocks laid out one after the other. In a block-major region a block
may be longer than its layers' pages (``block_bytes``): vLLM gives every cache group of a
block-outermost cache the largest group's block, the groups overlaying one allocation. The
one-slot kinds (mla, mamba) have no head axis to move, so ``heads_outer`` is dropped for them
(LHBNC and BHLNC are then the same bytes as LBHNC and BLHNC).

Every byte is addressed through :attr:`KVCacheLayout.planes`: a *plane* is a set of equal rows,
one per (head, token), at ``offset + head * head_stride + (token // kernel_block_size) *
kernel_stride + (token % kernel_block_size) * token_stride`` from the start of a block. Packed
attention has one plane, fp8/int8 head groups two (K, V), kv_planes two (a head's slice of each
plane), and nvfp4 four: within each side vLLM stores the 4-bit data of every (head, token) row
first, then every row's fp8 scales, the rows in the page's own order (FlashInfer's ``_nvfp4_kv_views``
over ``vllm.utils.torch_utils.nvfp4_split_data_scale``), so a head slice of an HND nvfp4 page is two
spans per side. nvfp4 pages are whole inside a block (LBHNC, LBNHC, BLHNC, BLNHC), never heads_outer.

Mamba state across TP sizes. An opaque mamba page moves only between equal TP sizes (rank r reads
rank r). A mamba layout may say how its state is split over TP ranks: ``segments``, the page's
parts in page order as this rank's byte sizes, each split evenly and contiguously over the ranks
(a segment is ``size x tp_size`` bytes, rank r holding ``[r * size, (r + 1) * size)`` of it: vLLM's
conv sub-projections x / B / C or Q / K / V in its DS conv layout, then the SSM state), so that a
rank of one TP size reads the slices it needs of each segment from the ranks of another; or
``replicated``: every rank holds the whole state, read from one rank as MLA's latent is.
"""

from kvxfer.layout.kinds import CacheKind, DType, Order, Packing, head_range
from kvxfer.layout.model import MAX_SEGMENTS, KVCacheLayout, Plane, RegionSpec

__all__ = [
    "MAX_SEGMENTS",
    "CacheKind",
    "DType",
    "KVCacheLayout",
    "Order",
    "Packing",
    "Plane",
    "RegionSpec",
    "head_range",
]
