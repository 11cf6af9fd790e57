"""KVCacheLayout: one cache group's layout, validated, and the geometry every transfer is planned
from (regions, planes, offsets, spans); see :mod:`kvxfer.layout` for the layouts it describes.

The class holds the fields and their normalization, one constructor per kind, the derived sizes and
every public method. The work behind the larger ones lives in the modules beside it, which import
the class for annotations only, so that none of them imports this module at run time:
``validation`` (the checks ``__post_init__`` runs), ``geometry`` (byte strides and planes), ``spans``
(the bytes of a head and token range), ``compat`` (what two layouts must share), ``segments`` (a
mamba page's TP split) and ``values`` (:class:`RegionSpec`, :class:`Plane`, :class:`TensorLike`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvxfer.errors import LayoutError
from kvxfer.layout.compat import layout_incompatibilities
from kvxfer.layout.geometry import Strides, byte_strides, natural_block_bytes, planes_of
from kvxfer.layout.kinds import NVFP4_GROUP, STRIDE_ORDERS, CacheKind, DType, Order, Packing, parse_enum
from kvxfer.layout.segments import MAX_SEGMENTS, check_segments, normalized_segments, reshard
from kvxfer.layout.spans import I64, row_offsets_of, spans_of
from kvxfer.layout.validation import check_block_bytes, check_flags, check_geometry, check_kind, check_numbers
from kvxfer.layout.values import Plane, RegionSpec, TensorLike

__all__ = ["MAX_SEGMENTS", "KVCacheLayout", "Plane", "RegionSpec", "TensorLike"]


@dataclass(frozen=True)
class KVCacheLayout:
    """A validated description of one KV-cache group on one rank.

    Build it with :meth:`attention`, :meth:`quantized`, :meth:`kv_planes`, :meth:`mla`,
    :meth:`mamba` or :meth:`from_tensor`; the constructor validates every field and raises
    :class:`LayoutError` naming the field that is off.
    """

    kind: CacheKind
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DType
    order: Order = Order.HND
    cross_layer: bool = False
    total_kv_heads: int = 0  # 0: same as num_kv_heads (no tensor parallelism)
    head_size_v: int = 0  # 0: same as head_size (attention caches may pack a V of another size)
    heads_outer: bool = False  # LHBNC / BHLNC: the head axis outside the blocks (or layers)
    page_stride: int = 0  # 0: no padding; else bytes between consecutive pages of a layer
    kernel_block_size: int = 0  # 0: blocks not split; else tokens per kernel block (vLLM's splitting)
    packing: Packing = Packing.KV  # attention only: K and V inside a (block, head) page
    block_bytes: int = 0  # block-major only; 0: a block is its layers' pages, else bytes from block to block
    #: mamba only: the page's TP-sharded segments as this rank's byte sizes, in page order (each
    #: split evenly and contiguously over the TP ranks); empty: an opaque page (equal TP only).
    segments: tuple[int, ...] = ()
    replicated: bool = False  # mamba only: every TP rank holds the whole state (read from any one)

    def __post_init__(self) -> None:
        # Parse, check and normalize in this order: each check (kvxfer.layout.validation) reads only
        # fields, and sizes derived from them, that the steps above it have made sane.
        object.__setattr__(self, "kind", parse_enum(CacheKind, self.kind, "kind"))
        object.__setattr__(self, "order", parse_enum(Order, self.order, "order"))
        object.__setattr__(self, "packing", parse_enum(Packing, self.packing, "packing"))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        check_numbers(self)
        object.__setattr__(self, "segments", normalized_segments(self.segments))
        check_flags(self)
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        # 0 is the canonical "same as the default", so that equal layouts compare equal and
        # dataclasses.replace() of another field never leaves a stale derived value behind.
        if self.head_size_v == self.head_size:
            object.__setattr__(self, "head_size_v", 0)
        if self.kernel_block_size == self.block_size:
            object.__setattr__(self, "kernel_block_size", 0)
        if self.kind in (CacheKind.MLA, CacheKind.MAMBA):
            object.__setattr__(self, "heads_outer", False)  # one slot: the head axis changes no byte
        check_kind(self)
        check_segments(self)
        if self.page_stride == self.page_bytes:
            object.__setattr__(self, "page_stride", 0)
        check_geometry(self)
        if self.block_bytes == natural_block_bytes(self):
            object.__setattr__(self, "block_bytes", 0)
        check_block_bytes(self)

    def __getstate__(self) -> dict[str, Any]:
        # Cached properties are derived state: do not send them along with a pickled layout.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def attention(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str | DType = DType.BF16,
        order: str | Order = Order.HND,
        total_kv_heads: int = 0,
        cross_layer: bool = False,
        head_size_v: int = 0,
        heads_outer: bool = False,
        page_stride: int = 0,
        kernel_block_size: int = 0,
        packing: str | Packing = Packing.KV,
        block_bytes: int = 0,
    ) -> KVCacheLayout:
        """Attention cache with K and V packed in the content dim: (B, H, N, head_size + head_size_v).

        bf16, fp16, fp32 and fp8 (e4m3, e5m2: one byte per element) caches all pack K and V this way;
        ``packing`` says how a kernel arranges them inside a (block, head) page (see :class:`Packing`).
        """
        return cls(
            CacheKind.ATTENTION, num_layers, num_blocks, block_size, num_kv_heads, head_size, DType.parse(dtype),
            parse_enum(Order, order, "order"), cross_layer, total_kv_heads, head_size_v, heads_outer, page_stride,
            kernel_block_size, parse_enum(Packing, packing, "packing"), block_bytes,
        )  # fmt: skip

    @classmethod
    def quantized(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str | DType = DType.FP8_E4M3,
        order: str | Order = Order.HND,
        total_kv_heads: int = 0,
        cross_layer: bool = False,
        heads_outer: bool = False,
        kernel_block_size: int = 0,
        block_bytes: int = 0,
    ) -> KVCacheLayout:
        """K and V as separate head groups: (B, 2*H, N, head_size) codes; nvfp4 as data then scales per side."""
        return cls(
            CacheKind.QUANTIZED, num_layers, num_blocks, block_size, num_kv_heads, head_size, DType.parse(dtype),
            parse_enum(Order, order, "order"), cross_layer, total_kv_heads, 0, heads_outer, 0, kernel_block_size,
            block_bytes=block_bytes,
        )  # fmt: skip

    @classmethod
    def kv_planes(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str | DType = DType.BF16,
        order: str | Order = Order.HND,
        total_kv_heads: int = 0,
        cross_layer: bool = False,
        kernel_block_size: int = 0,
        block_bytes: int = 0,
    ) -> KVCacheLayout:
        """A K plane and a V plane: (B, 2, N, num_kv_heads * head_size), vLLM's ``num_head_slots=2`` form."""
        return cls(
            CacheKind.KV_PLANES, num_layers, num_blocks, block_size, num_kv_heads, head_size, DType.parse(dtype),
            parse_enum(Order, order, "order"), cross_layer, total_kv_heads, 0, False, 0, kernel_block_size,
            block_bytes=block_bytes,
        )  # fmt: skip

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        latent_dim: int,
        dtype: str | DType = DType.BF16,
        cross_layer: bool = False,
        page_stride: int = 0,
        kernel_block_size: int = 0,
        block_bytes: int = 0,
    ) -> KVCacheLayout:
        """MLA cache: (B, N, kv_lora_rank + rope_dim), one latent head, replicated on every TP rank.

        An fp8 MLA row that carries its own scales is described as int8 (opaque bytes) with
        ``latent_dim`` = the row's bytes.
        """
        return cls(
            CacheKind.MLA, num_layers, num_blocks, block_size, 1, latent_dim, DType.parse(dtype), Order.NHD,
            cross_layer, 1, 0, False, page_stride, kernel_block_size, block_bytes=block_bytes,
        )  # fmt: skip

    @classmethod
    def mamba(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        page_size_bytes: int,
        cross_layer: bool = False,
        page_stride: int = 0,
        block_bytes: int = 0,
        segments: Sequence[int] = (),
        replicated: bool = False,
    ) -> KVCacheLayout:
        """Mamba page tensors: (B, 1, 1, page_size_bytes) int8, one region per layer.

        ``page_stride`` is the padded page vLLM allocates when it aligns Mamba pages with attention pages.
        How the state is split over TP ranks: ``segments`` are the page's parts in page order as this
        rank's byte sizes (they sum to ``page_size_bytes``), each split evenly and contiguously over
        the TP ranks (rank r holds bytes ``[r * size, (r + 1) * size)`` of a segment of ``size x
        tp_size`` bytes), so any two TP sizes can exchange pages; ``replicated``: every rank holds the
        whole state; neither: an opaque page, moved only between equal TP sizes.
        """
        return cls(
            CacheKind.MAMBA, num_layers, num_blocks, 1, 1, page_size_bytes, DType.INT8, Order.HND, cross_layer, 1, 0,
            False, page_stride, block_bytes=block_bytes, segments=tuple(segments), replicated=replicated,
        )  # fmt: skip

    # ----------------------------------------------------------------- derived sizes
    @property
    def stride_order(self) -> str:
        """vLLM's name of this physical order over [L, B, H, N, C] (``LBHNC`` ...)."""
        return STRIDE_ORDERS[(self.order, self.cross_layer, self.heads_outer)]

    @property
    def head_groups(self) -> int:
        """1, or 2 for quantized caches (a K group and a V group of heads)."""
        return 2 if self.kind is CacheKind.QUANTIZED else 1

    @property
    def slots(self) -> int:
        """``H`` of the [B, H, N, C] view: entries on the head axis of one page."""
        if self.kind is CacheKind.KV_PLANES:
            return 2
        return self.head_groups * self.num_kv_heads

    @property
    def entries(self) -> int:
        """Entries on the head axis of one page (same as :attr:`slots`)."""
        return self.slots

    @property
    def tokens_per_page(self) -> int:
        """Rows along the token axis of one block (1 for Mamba)."""
        return self.block_size

    @property
    def element_bytes(self) -> int:
        """Bytes of one element (nvfp4: 1, the packed byte)."""
        return max(1, self.dtype.bits // 8)

    @property
    def row_bytes(self) -> int:
        """Bytes of one (slot, token) cell: ``C`` of the [B, H, N, C] view, in bytes."""
        if self.kind is CacheKind.MAMBA:
            return self.head_size
        if self.dtype is DType.NVFP4:
            return self.head_size // 2 + self.head_size // NVFP4_GROUP
        content = {
            CacheKind.ATTENTION: self.head_size + self.v_head_size,
            CacheKind.KV_PLANES: self.num_kv_heads * self.head_size,
        }.get(self.kind, self.head_size)
        return content * self.dtype.bits // 8

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (without padding): what moves for a whole block."""
        return self.tokens_per_page * self.slots * self.row_bytes

    @property
    def v_head_size(self) -> int:
        """Elements of one head's V (``head_size_v``, or ``head_size`` when that is 0)."""
        return self.head_size_v or self.head_size

    @property
    def padded_page_bytes(self) -> int:
        """Bytes between consecutive pages of one layer (``page_stride``, or ``page_bytes`` when 0)."""
        return self.page_stride or self.page_bytes

    @property
    def tokens_per_kernel_block(self) -> int:
        """Tokens per kernel block (``kernel_block_size``, or ``block_size`` when blocks are not split)."""
        return self.kernel_block_size or self.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        """How many kernel blocks vLLM splits one block into (1: no splitting)."""
        return self.block_size // self.tokens_per_kernel_block

    @property
    def num_regions(self) -> int:
        """Regions to register: one per layer, or one for a cross-layer cache."""
        return 1 if self.cross_layer else self.num_layers

    @cached_property
    def _strides(self) -> Strides:
        """Byte strides of (layer inside a region, kernel block, slot, token, manager block)."""
        return byte_strides(self)

    @property
    def layer_stride(self) -> int:
        """Bytes between layer l and layer l+1 of a block inside a cross-layer region (0: a region per layer)."""
        return self._strides[0]

    @property
    def block_stride(self) -> int:
        """Bytes between block b and block b+1 of the same layer (and head)."""
        return self._strides[4]

    @property
    def region_bytes(self) -> int:
        """Bytes of one region."""
        if not self.cross_layer:
            return self.num_blocks * (self.page_bytes if self.heads_outer else self.padded_page_bytes)
        # The last block ends with its layers' pages: slack after it belongs to nobody (another group's
        # bytes, or the end of vLLM's allocation).
        return (self.num_blocks - 1) * self.block_stride + natural_block_bytes(self)

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole cache group on this rank."""
        return self.region_bytes * self.num_regions

    @cached_property
    def planes(self) -> tuple[Plane, ...]:
        """The rows of one block, plane by plane (see :class:`Plane`); ordered by offset in an HND page."""
        return planes_of(self, self._strides)

    def regions(self) -> tuple[RegionSpec, ...]:
        """The regions to register, in region-index order."""
        if self.cross_layer:
            return (RegionSpec(0, 0, self.num_layers, self.region_bytes),)
        return tuple(RegionSpec(i, i, 1, self.region_bytes) for i in range(self.num_layers))

    def region_of_layer(self, layer: int) -> int:
        """Index of the region that holds ``layer``."""
        self._check_layer(layer)
        return 0 if self.cross_layer else layer

    def layer_offset(self, layer: int) -> int:
        """Offset of ``layer``'s block 0 inside its region (non-zero only for cross-layer caches)."""
        self._check_layer(layer)
        return layer * self._strides[0]

    def block_offset(self, layer: int, block: int) -> int:
        """Offset of the start of ``block`` of ``layer`` inside its region (the planes' origin)."""
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block: {block} is not in [0, {self.num_blocks})", field="block")
        return self.layer_offset(layer) + block * self.block_stride

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer: {layer} is not in [0, {self.num_layers})", field="layer")

    def view_geometry(self) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """Shape and byte strides of one layer's 4-D ``[B, H, N, C]`` view (C in bytes).

        With kernel blocks, B counts kernel blocks and N their tokens (the view vLLM creates).
        """
        _, kblock, slot, tok, _ = self._strides
        r = self.kernel_blocks_per_block
        return (self.num_blocks * r, self.slots, self.tokens_per_kernel_block, self.row_bytes), (kblock, slot, tok, 1)

    def plane_view(self, layer: int, plane: Plane) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """``plane``'s rows of ``layer`` as a strided byte array over its region.

        Returns (offset in the region, shape, byte strides) of a (blocks, kernel blocks per block,
        heads, tokens per kernel block, elements, row bytes) array, for ``numpy.lib.stride_tricks.as_strided``
        or ``torch.as_strided`` on the region's bytes.
        """
        heads = 1 if self.kind in (CacheKind.MLA, CacheKind.MAMBA) else self.num_kv_heads
        shape = (self.num_blocks, self.kernel_blocks_per_block, heads, self.tokens_per_kernel_block, plane.elements,
                 plane.row_bytes)  # fmt: skip
        strides = (
            self.block_stride,
            plane.kernel_stride,
            plane.head_stride,
            plane.token_stride,
            plane.element_stride,
            1,
        )
        return self.layer_offset(layer) + plane.offset, shape, strides

    # ----------------------------------------------------------------- byte spans
    def row_offsets(self, heads: I64, tokens: I64) -> tuple[I64, I64]:
        """Offsets (from a block's start) and lengths of every row piece of ``heads`` x ``tokens``.

        Flat arrays, in (plane, head, token, element) order; heads are local head indices, tokens
        indices inside the block. Pure arithmetic, no checks.
        """
        return row_offsets_of(self, heads, tokens)

    def spans(
        self,
        layer: int,
        block: int,
        heads: tuple[int, int] | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> list[tuple[int, int]]:
        """Byte spans ``(offset in region, length)`` holding ``heads`` x ``tokens`` of one block.

        ``heads`` is a range of local heads (each brings all of its parts: K and V, data and
        scales); adjacent spans are merged. With HND a head range of whole blocks is one span (two
        per side for nvfp4), with NHD it is one span per token unless all heads are asked for.
        """
        return spans_of(self, layer, block, heads, tokens)

    # ----------------------------------------------------------------- compatibility
    def incompatibilities(self, other: KVCacheLayout) -> list[str]:
        """Every reason blocks cannot move between ``self`` (local) and ``other`` (remote).

        An empty list means compatible. Head counts per rank, block counts, physical order,
        cross-layer packing, padding, kernel blocks and block sizes that are multiples of each
        other may differ.
        """
        return layout_incompatibilities(self, other)

    def resharded(self, tp_size: int, new_tp_size: int) -> KVCacheLayout:
        """This rank's layout of a ``tp_size``-way split as a rank of a ``new_tp_size``-way split holds it.

        Only a mamba page split in :attr:`segments` changes (each segment scaled, without padding);
        raises :class:`LayoutError` naming ``segments`` when a segment does not split evenly.
        """
        return reshard(self, tp_size, new_tp_size)

    def is_compatible(self, other: KVCacheLayout) -> bool:
        """True when :meth:`incompatibilities` finds nothing."""
        return not self.incompatibilities(other)

    # ----------------------------------------------------------------- wire form
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (enum values as strings)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["kind"], out["dtype"], out["order"] = self.kind.value, self.dtype.value, self.order.value
        out["packing"] = self.packing.value
        out["segments"] = list(self.segments)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheLayout:
        """Inverse of :meth:`to_dict`; unknown or missing keys raise :class:`LayoutError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise LayoutError(f"layout: unknown keys {unknown}", field=unknown[0])
        required = {"kind", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size", "dtype"}
        missing = sorted(required - set(data))
        if missing:
            raise LayoutError(f"layout: missing keys {missing}", field=missing[0])
        return cls(**dict(data))

    # ----------------------------------------------------------------- from a tensor
    @classmethod
    def from_tensor(
        cls,
        tensor: TensorLike,
        kind: str | CacheKind = CacheKind.ATTENTION,
        *,
        dtype: str | DType | None = None,
        total_kv_heads: int = 0,
        head_size: int | None = None,
    ) -> KVCacheLayout:
        """Describe a cache tensor after checking its shape and strides.

        The tensor is given in its *logical* shape (see :mod:`kvxfer.layout`); a leading layers
        dimension makes it a cross-layer cache, whose strides must be block-major (stride order
        (1, 0, 2, ...)). HND or NHD is read from the strides. torch tensors (strides in elements) and numpy
        arrays (strides in bytes) are accepted. ``dtype`` overrides the tensor's dtype (needed for
        nvfp4, stored as uint8 rows); ``head_size`` is required for nvfp4 and kv_planes. Padded
        pages and kernel blocks cannot be told from a tensor: vLLM's caches are described from
        vLLM's own spec objects instead (:mod:`kvxfer.integrations.vllm.spec`).
        """
        # The reader builds layouts with this class's constructors: imported when first used.
        from kvxfer.layout.tensor import layout_of_tensor

        return layout_of_tensor(tensor, kind, dtype=dtype, total_kv_heads=total_kv_heads, head_size=head_size)
