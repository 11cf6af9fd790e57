"""Standardized KV-cache layouts: a frozen, validated description of one cache group.

A *cache group* is a set of layers whose caches share one shape: every attention layer of a
model, or every Mamba layer. All caches are blocks-first. Physically, one block of one layer is a
contiguous *page*; inside a page, the head axis holds ``head_groups * num_kv_heads`` *entries*
(one entry per head, or per K head then per V head for quantized caches) and every
(token, entry) pair is one *row* of ``row_bytes`` contiguous bytes:

============  ===============================  ===========================================
kind          logical tensor shape             row
============  ===============================  ===========================================
attention     (B, H, N, 2*head_size)           K and V of one head and token, packed
quantized     (B, 2*H, N, head_size)           K heads first, then V heads (fp8, nvfp4, int8)
mla           (B, N, latent_dim)               the latent of one token (one "head")
mamba         (B, 1, 1, page_size_bytes) int8  the whole page (conv + ssm state)
============  ===============================  ===========================================

With order HND the rows of one entry are contiguous (entry-major), with NHD the rows of one token
are (token-major). A cross-layer cache stores every layer of a block next to each other: one
region holds all layers and a layer's block stride is ``num_layers * page_bytes``.

nvfp4 packs two 4-bit values per byte and keeps one fp8 scale byte per 16 values; kvxfer describes
such a row as ``head_size // 2`` data bytes followed by ``head_size // 16`` scale bytes, so a
page's byte count is exact. The tensor handed to :meth:`KVCacheLayout.from_tensor` is then uint8
with a last dimension of ``row_bytes``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvxfer.errors import LayoutError

__all__ = [
    "CacheKind",
    "DType",
    "KVCacheLayout",
    "Order",
    "RegionSpec",
    "head_range",
]


_E = TypeVar("_E", bound=enum.Enum)


class CacheKind(enum.StrEnum):
    """What a cache group holds."""

    ATTENTION = "attention"
    QUANTIZED = "quantized"
    MLA = "mla"
    MAMBA = "mamba"


class Order(enum.StrEnum):
    """Physical order of the head and token axes inside a page."""

    NHD = "NHD"
    HND = "HND"


class DType(enum.StrEnum):
    """Element types of KV caches, with their storage size."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    NVFP4 = "nvfp4"
    INT8 = "int8"

    @property
    def bits(self) -> int:
        """Bits per element (without nvfp4's scale bytes)."""
        return _DTYPE_BITS[self]

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        """Accept kvxfer names and the common torch/vLLM spellings (``bfloat16``, ``fp8``...)."""
        if isinstance(value, DType):
            return value
        key = str(value).strip().lower().removeprefix("torch.")
        try:
            return _DTYPE_ALIASES[key]
        except KeyError:
            known = ", ".join(sorted(_DTYPE_ALIASES))
            raise LayoutError(f"dtype: unknown dtype {value!r}; known: {known}", field="dtype") from None


_DTYPE_BITS = {
    DType.BF16: 16,
    DType.FP16: 16,
    DType.FP32: 32,
    DType.FP8_E4M3: 8,
    DType.FP8_E5M2: 8,
    DType.NVFP4: 4,
    DType.INT8: 8,
}

_DTYPE_ALIASES: dict[str, DType] = {
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "half": DType.FP16,
    "fp32": DType.FP32,
    "float32": DType.FP32,
    "float": DType.FP32,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
    "float8_e5m2": DType.FP8_E5M2,
    "nvfp4": DType.NVFP4,
    "int8": DType.INT8,
    "uint8": DType.INT8,
}

# Quantized head-group caches hold one-byte (or packed) codes only.
_QUANTIZED_DTYPES = frozenset({DType.FP8_E4M3, DType.FP8_E5M2, DType.NVFP4, DType.INT8})
NVFP4_GROUP = 16


def head_range(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV-head range ``[start, stop)`` held by one tensor-parallel rank.

    Heads are split evenly when there are at least as many heads as ranks; with more ranks than
    heads each head is replicated on ``tp_size // total_heads`` consecutive ranks (vLLM's rule).
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank: {tp_rank} is not in [0, {tp_size})", field="tp_rank")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise LayoutError(
                f"total_kv_heads: {total_heads} heads cannot be split evenly over tp_size {tp_size}",
                field="total_kv_heads",
            )
        per = total_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total_heads:
        raise LayoutError(f"tp_size: {tp_size} ranks cannot replicate {total_heads} heads evenly", field="tp_size")
    head = tp_rank // (tp_size // total_heads)
    return head, head + 1


@dataclass(frozen=True)
class RegionSpec:
    """One contiguous memory region to register: which layers it holds and its size in bytes."""

    index: int
    first_layer: int
    num_layers: int
    nbytes: int


class _TensorLike(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...


@dataclass(frozen=True)
class KVCacheLayout:
    """A validated description of one KV-cache group on one rank.

    Build it with :meth:`attention`, :meth:`quantized`, :meth:`mla`, :meth:`mamba` or
    :meth:`from_tensor`; the constructor validates every field and raises :class:`LayoutError`
    naming the field that is off.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse_enum(CacheKind, self.kind, "kind"))
        object.__setattr__(self, "order", _parse_enum(Order, self.order, "order"))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}: must be a positive integer, got {value!r}", field=name)
        if not isinstance(self.cross_layer, bool):
            raise LayoutError(f"cross_layer: must be a bool, got {self.cross_layer!r}", field="cross_layer")
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if isinstance(self.total_kv_heads, bool) or not isinstance(self.total_kv_heads, int):
            raise LayoutError(
                f"total_kv_heads: must be an integer, got {self.total_kv_heads!r}", field="total_kv_heads"
            )
        if self.total_kv_heads < 1:
            raise LayoutError(f"total_kv_heads: must be positive, got {self.total_kv_heads}", field="total_kv_heads")
        self._validate_kind()

    def _validate_kind(self) -> None:
        kind, dtype = self.kind, self.dtype
        if kind in (CacheKind.MLA, CacheKind.MAMBA) and (self.num_kv_heads != 1 or self.total_kv_heads != 1):
            raise LayoutError(
                f"num_kv_heads: a {kind} cache has one head per block, got num_kv_heads={self.num_kv_heads}, "
                f"total_kv_heads={self.total_kv_heads}",
                field="num_kv_heads",
            )
        if kind is CacheKind.MAMBA:
            if dtype is not DType.INT8:
                raise LayoutError(f"dtype: a mamba page tensor is int8, got {dtype}", field="dtype")
            if self.block_size != 1:
                raise LayoutError(
                    f"block_size: a mamba page has no token axis; use block_size=1, got {self.block_size}",
                    field="block_size",
                )
        if kind is CacheKind.QUANTIZED and dtype not in _QUANTIZED_DTYPES:
            allowed = ", ".join(sorted(d.value for d in _QUANTIZED_DTYPES))
            raise LayoutError(f"dtype: a quantized head-group cache holds {allowed}, got {dtype}", field="dtype")
        if dtype is DType.NVFP4:
            if kind is not CacheKind.QUANTIZED:
                raise LayoutError(
                    f"dtype: nvfp4 is only defined for quantized head-group caches, not {kind}", field="dtype"
                )
            if self.head_size % NVFP4_GROUP:
                raise LayoutError(
                    f"head_size: nvfp4 needs a multiple of {NVFP4_GROUP}, got {self.head_size}",
                    field="head_size",
                )
        if self.num_kv_heads > self.total_kv_heads:
            raise LayoutError(
                f"num_kv_heads: {self.num_kv_heads} local heads exceed total_kv_heads={self.total_kv_heads}",
                field="num_kv_heads",
            )

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
    ) -> KVCacheLayout:
        """Attention cache with K and V packed in the content dim: (B, H, N, 2*head_size)."""
        return cls(
            CacheKind.ATTENTION, num_layers, num_blocks, block_size, num_kv_heads, head_size,
            DType.parse(dtype), _parse_enum(Order, order, "order"), cross_layer, total_kv_heads,
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
    ) -> KVCacheLayout:
        """Quantized cache with K and V as separate head groups: (B, 2*H, N, head_size)."""
        return cls(
            CacheKind.QUANTIZED, num_layers, num_blocks, block_size, num_kv_heads, head_size,
            DType.parse(dtype), _parse_enum(Order, order, "order"), cross_layer, total_kv_heads,
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
    ) -> KVCacheLayout:
        """MLA cache: (B, N, kv_lora_rank + rope_dim), one latent head, replicated on every TP rank."""
        return cls(
            CacheKind.MLA, num_layers, num_blocks, block_size, 1, latent_dim,
            DType.parse(dtype), Order.NHD, cross_layer, 1,
        )  # fmt: skip

    @classmethod
    def mamba(
        cls, *, num_layers: int, num_blocks: int, page_size_bytes: int, cross_layer: bool = False
    ) -> KVCacheLayout:
        """Mamba page tensors: (B, 1, 1, page_size_bytes) int8, one region per layer."""
        return cls(
            CacheKind.MAMBA, num_layers, num_blocks, 1, 1, page_size_bytes, DType.INT8, Order.HND, cross_layer, 1
        )

    # ----------------------------------------------------------------- derived sizes
    @property
    def head_groups(self) -> int:
        """1, or 2 for quantized caches (a K group and a V group of heads)."""
        return 2 if self.kind is CacheKind.QUANTIZED else 1

    @property
    def entries(self) -> int:
        """Entries on the head axis of one page (``head_groups * num_kv_heads``)."""
        return self.head_groups * self.num_kv_heads

    @property
    def tokens_per_page(self) -> int:
        """Rows along the token axis of one page (1 for Mamba)."""
        return self.block_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, entry) row."""
        if self.kind is CacheKind.MAMBA:
            return self.head_size
        if self.dtype is DType.NVFP4:
            return self.head_size // 2 + self.head_size // NVFP4_GROUP
        content = 2 * self.head_size if self.kind is CacheKind.ATTENTION else self.head_size
        return content * self.dtype.bits // 8

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.tokens_per_page * self.entries * self.row_bytes

    @property
    def num_regions(self) -> int:
        """Regions to register: one per layer, or one for a cross-layer cache."""
        return 1 if self.cross_layer else self.num_layers

    @property
    def block_stride(self) -> int:
        """Bytes between block b and block b+1 of the same layer."""
        return self.page_bytes * (self.num_layers if self.cross_layer else 1)

    @property
    def region_bytes(self) -> int:
        """Bytes of one region."""
        return self.num_blocks * self.block_stride

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole cache group on this rank."""
        return self.region_bytes * self.num_regions

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
        """Offset of ``layer``'s page inside a block (non-zero only for cross-layer caches)."""
        self._check_layer(layer)
        return layer * self.page_bytes if self.cross_layer else 0

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer: {layer} is not in [0, {self.num_layers})", field="layer")

    # ----------------------------------------------------------------- byte spans
    def spans(
        self,
        layer: int,
        block: int,
        heads: tuple[int, int] | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> list[tuple[int, int]]:
        """Byte spans ``(offset in region, length)`` holding ``heads`` x ``tokens`` of one block.

        ``heads`` is a range of local heads (each head also brings its V-group twin in a quantized
        cache); adjacent spans are merged. With HND a head range of whole blocks is one span, with
        NHD it is one span per token unless all heads are asked for.
        """
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block: {block} is not in [0, {self.num_blocks})", field="block")
        h0, h1 = heads if heads is not None else (0, self.num_kv_heads)
        t0, t1 = tokens if tokens is not None else (0, self.tokens_per_page)
        if not 0 <= h0 < h1 <= self.num_kv_heads:
            raise LayoutError(f"heads: {heads} is not a range inside [0, {self.num_kv_heads})", field="heads")
        if not 0 <= t0 < t1 <= self.tokens_per_page:
            raise LayoutError(f"tokens: {tokens} is not a range inside [0, {self.tokens_per_page})", field="tokens")
        base = self.layer_offset(layer) + block * self.block_stride
        row, n, e = self.row_bytes, self.tokens_per_page, self.entries
        out: list[tuple[int, int]] = []
        for g in range(self.head_groups):
            first, last = g * self.num_kv_heads + h0, g * self.num_kv_heads + h1
            if self.order is Order.HND:
                pieces = [((entry * n + t0) * row, (t1 - t0) * row) for entry in range(first, last)]
            else:
                pieces = [((t * e + first) * row, (last - first) * row) for t in range(t0, t1)]
            out.extend(pieces)
        out.sort()
        merged: list[tuple[int, int]] = []
        for off, length in out:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        return [(base + off, length) for off, length in merged]

    # ----------------------------------------------------------------- compatibility
    def incompatibilities(self, other: KVCacheLayout) -> list[str]:
        """Every reason blocks cannot move between ``self`` (local) and ``other`` (remote).

        An empty list means compatible. Head counts per rank, block counts, physical order,
        cross-layer packing and block sizes that are multiples of each other may differ.
        """
        diffs: list[str] = []

        def differ(name: str, mine: object, theirs: object) -> None:
            if mine != theirs:
                diffs.append(f"{name}: local {mine}, remote {theirs}")

        differ("kind", self.kind.value, other.kind.value)
        differ("dtype", self.dtype.value, other.dtype.value)
        differ("num_layers", self.num_layers, other.num_layers)
        # head_size holds the latent dim of an MLA cache and the page bytes of a Mamba one.
        size_name = {CacheKind.MLA: "latent_dim", CacheKind.MAMBA: "page_size_bytes"}.get(self.kind, "head_size")
        differ(size_name if self.kind is other.kind else "head_size", self.head_size, other.head_size)
        differ("total_kv_heads", self.total_kv_heads, other.total_kv_heads)
        small, large = sorted((self.block_size, other.block_size))
        if large % small:
            diffs.append(
                f"block_size: local {self.block_size}, remote {other.block_size} (neither is a multiple of the other)"
            )
        return diffs

    def is_compatible(self, other: KVCacheLayout) -> bool:
        """True when :meth:`incompatibilities` finds nothing."""
        return not self.incompatibilities(other)

    # ----------------------------------------------------------------- wire form
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (enum values as strings)."""
        out = dataclasses.asdict(self)
        out["kind"], out["dtype"], out["order"] = self.kind.value, self.dtype.value, self.order.value
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
        tensor: _TensorLike,
        kind: str | CacheKind = CacheKind.ATTENTION,
        *,
        dtype: str | DType | None = None,
        total_kv_heads: int = 0,
        head_size: int | None = None,
    ) -> KVCacheLayout:
        """Describe a cache tensor after checking its shape and strides.

        The tensor is given in its *logical* shape (see the module docstring); a leading layers
        dimension makes it a cross-layer cache, whose strides must be block-major (stride order
        (1, 0, 2, ...)). HND or NHD is read from the strides. torch tensors (strides in elements)
        and numpy arrays (strides in bytes) are accepted. ``dtype`` overrides the tensor's dtype
        (needed for nvfp4, stored as uint8 rows); ``head_size`` is required for nvfp4.
        """
        kind = _parse_enum(CacheKind, kind, "kind")
        shape = tuple(int(s) for s in tensor.shape)
        strides = _element_strides(tensor)
        dt = DType.parse(dtype if dtype is not None else _dtype_name(tensor.dtype))
        base_ndim = 3 if kind is CacheKind.MLA else 4
        if len(shape) not in (base_ndim, base_ndim + 1):
            raise LayoutError(
                f"shape: a {kind} cache tensor has {base_ndim} dims (or {base_ndim + 1} with a leading layers dim), "
                f"got {len(shape)} dims {shape}",
                field="shape",
            )
        cross = len(shape) == base_ndim + 1
        layers = shape[0] if cross else 1
        dims, st = (shape[1:], strides[1:]) if cross else (shape, strides)
        if kind is CacheKind.MLA:
            nb, n, d = dims
            layout = cls.mla(num_layers=layers, num_blocks=nb, block_size=n, latent_dim=d, dtype=dt, cross_layer=cross)
            _expect_strides(st[1:], (d, 1), ("tokens", "latent"), dims[1:], first_dim=1 + cross)
        elif kind is CacheKind.MAMBA:
            nb, one_a, one_b, page = dims
            if (one_a, one_b) != (1, 1):
                raise LayoutError(f"shape: a mamba page tensor is (B, 1, 1, page_bytes), got {shape}", field="shape")
            if dt is not DType.INT8:
                raise LayoutError(f"dtype: a mamba page tensor is int8, got {dt}", field="dtype")
            layout = cls.mamba(num_layers=layers, num_blocks=nb, page_size_bytes=page, cross_layer=cross)
            _expect_strides(st[3:], (1,), ("page",), dims[3:], first_dim=3 + cross)
        else:
            nb, e, n, content = dims
            groups = 2 if kind is CacheKind.QUANTIZED else 1
            if e % groups:
                raise LayoutError(f"shape: dim 1 of a quantized cache is 2*num_kv_heads, got {e}", field="shape")
            heads = e // groups
            if dt is DType.NVFP4:
                if head_size is None:
                    raise LayoutError(
                        "head_size: required for an nvfp4 tensor (its last dim is bytes)", field="head_size"
                    )
                hs = head_size
            elif kind is CacheKind.ATTENTION:
                if content % 2:
                    raise LayoutError(
                        f"shape: the last dim packs K and V (2*head_size), got odd {content}", field="shape"
                    )
                hs = content // 2
            else:
                hs = content
            order = Order.HND if e == 1 or st[1] >= st[2] else Order.NHD
            layout = cls(kind, layers, nb, n, heads, hs, dt, order, cross, total_kv_heads)
            row_elems = content
            hnd = order is Order.HND
            expected = (n * row_elems, row_elems, 1) if hnd else (row_elems, e * row_elems, 1)
            _expect_strides(st[1:], expected, ("heads", "tokens", "content"), dims[1:], first_dim=1 + cross)
            if dt is DType.NVFP4 and content != layout.row_bytes:
                raise LayoutError(
                    f"shape: an nvfp4 row of head_size {hs} is {layout.row_bytes} bytes, last dim is {content}",
                    field="shape",
                )
        page_elems = layout.page_bytes * 8 // _storage_bits(dt, kind)
        # The stride of a dim of size 1 never addresses anything, so any value is fine there.
        if dims[0] > 1 and st[0] != layout.block_stride * 8 // _storage_bits(dt, kind):
            raise LayoutError(
                f"strides: the blocks dim (dim {int(cross)}) has stride {st[0]}, the standardized layout needs "
                f"{layout.block_stride * 8 // _storage_bits(dt, kind)} (pages of {page_elems} elements"
                + (f" x {layers} layers, block-major)" if cross else ")"),
                field="strides",
            )
        if cross and layers > 1 and strides[0] != page_elems:
            raise LayoutError(
                f"strides: a cross-layer cache is block-major (stride order (1, 0, 2, ...)): the layers dim "
                f"needs stride {page_elems}, got {strides[0]}",
                field="strides",
            )
        return layout


def _storage_bits(dt: DType, kind: CacheKind) -> int:
    # nvfp4 tensors are stored as uint8 rows; every other dtype as its own elements.
    return 8 if dt is DType.NVFP4 or kind is CacheKind.MAMBA else dt.bits


def _parse_enum(cls: type[_E], value: object, field: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise LayoutError(f"{field}: {value!r} is not one of {allowed}", field=field) from None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _element_strides(tensor: Any) -> tuple[int, ...]:
    stride = getattr(tensor, "stride", None)
    if callable(stride):  # torch: strides in elements
        return tuple(int(s) for s in stride())
    strides = getattr(tensor, "strides", None)
    if strides is None:
        raise LayoutError("tensor: object has neither stride() nor strides", field="tensor")
    itemsize = int(tensor.itemsize)
    return tuple(int(s) // itemsize for s in strides)


def _expect_strides(
    got: Sequence[int], expected: Sequence[int], names: Sequence[str], sizes: Sequence[int], *, first_dim: int
) -> None:
    for name, g, e, n, dim in zip(names, got, expected, sizes, range(first_dim, first_dim + len(names)), strict=True):
        if g != e and n > 1:
            raise LayoutError(
                f"strides: dim {dim} ({name}) has stride {g}, the standardized layout needs {e} "
                f"(got strides {tuple(got)}, expected {tuple(expected)})",
                field="strides",
            )
