"""The vocabulary of a layout: cache kinds, physical orders, K/V packings, element types, and which
heads a tensor-parallel rank holds."""

from __future__ import annotations

import enum
from typing import TypeVar

from kvxfer.errors import LayoutError

__all__ = ["NVFP4_GROUP", "QUANTIZED_DTYPES", "STRIDE_ORDERS", "CacheKind", "DType", "Order", "Packing",
           "head_range", "parse_enum"]  # fmt: skip

_E = TypeVar("_E", bound=enum.Enum)


class CacheKind(enum.StrEnum):
    """What a cache group holds."""

    ATTENTION = "attention"
    QUANTIZED = "quantized"
    KV_PLANES = "kv_planes"
    MLA = "mla"
    MAMBA = "mamba"


class Order(enum.StrEnum):
    """Physical order of the head and token axes inside a page."""

    NHD = "NHD"
    HND = "HND"


class Packing(enum.StrEnum):
    """How an attention cache arranges K and V inside the page of one (block, head).

    ``kv``: the standardized layout, each token's K then V (every GPU backend). ``cpu_kt``: vLLM's
    CPU kernels on AVX-512/AVX2 (ISA ``vec``/``vec16``): all of the head's K transposed (head_size x
    tokens), then its V rows. ``head_block``: an arrangement private to a kernel (vLLM's CPU AMX,
    NEON... ISAs): a head's block moves whole, so head slices move but token ranges do not.
    """

    KV = "kv"
    CPU_KT = "cpu_kt"
    HEAD_BLOCK = "head_block"


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
QUANTIZED_DTYPES = frozenset({DType.FP8_E4M3, DType.FP8_E5M2, DType.NVFP4, DType.INT8})
NVFP4_GROUP = 16

# vLLM's names of the physical orders (vllm/v1/kv_cache_layout.py), by (order, cross_layer, heads_outer).
STRIDE_ORDERS = {
    (Order.HND, False, False): "LBHNC",
    (Order.NHD, False, False): "LBNHC",
    (Order.HND, False, True): "LHBNC",
    (Order.HND, True, False): "BLHNC",
    (Order.NHD, True, False): "BLNHC",
    (Order.HND, True, True): "BHLNC",
}


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


def parse_enum(cls: type[_E], value: object, field: str) -> _E:
    """``value`` as a member of ``cls``; a LayoutError naming ``field`` and the allowed values otherwise."""
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise LayoutError(f"{field}: {value!r} is not one of {allowed}", field=field) from None
