"""Reading a layout from a cache tensor (:meth:`KVCacheLayout.from_tensor`): its logical shape and
its strides, checked against the standardized layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvxfer.errors import LayoutError
from kvxfer.layout.kinds import CacheKind, DType, Order, parse_enum
from kvxfer.layout.model import KVCacheLayout
from kvxfer.layout.values import TensorLike

__all__ = ["layout_of_tensor"]


def layout_of_tensor(
    tensor: TensorLike,
    kind: str | CacheKind = CacheKind.ATTENTION,
    *,
    dtype: str | DType | None = None,
    total_kv_heads: int = 0,
    head_size: int | None = None,
) -> KVCacheLayout:
    """:meth:`KVCacheLayout.from_tensor`: the layout of a cache tensor, after checking its shape and strides."""
    kind = parse_enum(CacheKind, kind, "kind")
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
    bits = _storage_bits(dt, kind)
    if kind is CacheKind.MLA:
        nb, n, d = dims
        layout = KVCacheLayout.mla(
            num_layers=layers, num_blocks=nb, block_size=n, latent_dim=d, dtype=dt, cross_layer=cross
        )
        _expect_strides(st[1:], (d, 1), ("tokens", "latent"), dims[1:], first_dim=1 + cross)
    elif kind is CacheKind.MAMBA:
        nb, one_a, one_b, page = dims
        if (one_a, one_b) != (1, 1):
            raise LayoutError(f"shape: a mamba page tensor is (B, 1, 1, page_bytes), got {shape}", field="shape")
        if dt is not DType.INT8:
            raise LayoutError(f"dtype: a mamba page tensor is int8, got {dt}", field="dtype")
        layout = KVCacheLayout.mamba(num_layers=layers, num_blocks=nb, page_size_bytes=page, cross_layer=cross)
        _expect_strides(st[3:], (1,), ("page",), dims[3:], first_dim=3 + cross)
    else:
        layout = _describe_head_axis(kind, dims, st, dt, layers, cross, total_kv_heads, head_size)
    expected_block = layout.block_stride * 8 // bits
    if dims[0] > 1 and st[0] != expected_block:
        page_elems = layout.page_bytes * 8 // bits
        raise LayoutError(
            f"strides: the blocks dim (dim {int(cross)}) has stride {st[0]}, the standardized layout needs "
            f"{expected_block} (pages of {page_elems} elements"
            + (f" x {layers} layers, block-major)" if cross else ")"),
            field="strides",
        )
    if cross and layers > 1 and strides[0] != layout.page_bytes * 8 // bits:
        raise LayoutError(
            f"strides: a cross-layer cache is block-major (stride order (1, 0, 2, ...)): the layers dim "
            f"needs stride {layout.page_bytes * 8 // bits}, got {strides[0]}",
            field="strides",
        )
    return layout


def _describe_head_axis(
    kind: CacheKind, dims: Sequence[int], st: Sequence[int], dt: DType, layers: int, cross: bool,
    total_kv_heads: int, head_size: int | None,
) -> KVCacheLayout:  # fmt: skip
    """Attention, quantized and kv_planes tensors: (B, slots, N, content) read with their strides."""
    nb, e, n, content = dims
    if kind is CacheKind.KV_PLANES:
        if e != 2:
            raise LayoutError(f"shape: dim 1 of a kv_planes cache is 2 (a K and a V plane), got {e}", field="shape")
        if head_size is None or content % head_size:
            raise LayoutError(
                f"head_size: required for a kv_planes tensor and must divide its last dim {content}, got {head_size}",
                field="head_size",
            )
        heads, hs = content // head_size, head_size
    else:
        groups = 2 if kind is CacheKind.QUANTIZED else 1
        if e % groups:
            raise LayoutError(f"shape: dim 1 of a quantized cache is 2*num_kv_heads, got {e}", field="shape")
        heads = e // groups
        if dt is DType.NVFP4:
            if head_size is None:
                raise LayoutError("head_size: required for an nvfp4 tensor (its last dim is bytes)", field="head_size")
            hs = head_size
        elif kind is CacheKind.ATTENTION:
            if content % 2:
                raise LayoutError(f"shape: the last dim packs K and V (2*head_size), got odd {content}", field="shape")
            hs = content // 2
        else:
            hs = content
    order = Order.HND if e == 1 or st[1] >= st[2] else Order.NHD
    layout = KVCacheLayout(kind, layers, nb, n, heads, hs, dt, order, cross, total_kv_heads)
    hnd = order is Order.HND
    expected = (n * content, content, 1) if hnd else (content, e * content, 1)
    _expect_strides(st[1:], expected, ("heads", "tokens", "content"), dims[1:], first_dim=1 + cross)
    if dt is DType.NVFP4 and content != layout.row_bytes:
        raise LayoutError(
            f"shape: an nvfp4 row of head_size {hs} is {layout.row_bytes} bytes, last dim is {content}",
            field="shape",
        )
    return layout


def _storage_bits(dt: DType, kind: CacheKind) -> int:
    # nvfp4 tensors are stored as uint8 rows; every other dtype as its own elements.
    return 8 if dt is DType.NVFP4 or kind is CacheKind.MAMBA else dt.bits


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
