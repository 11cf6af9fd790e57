"""KVCacheLayout: sizes, spans, tensors in, and errors that name what is off."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.errors import LayoutError
from kvxfer.layout import CacheKind, DType, KVCacheLayout, Order, Packing, head_range


def test_llama_8b_page_and_region_bytes() -> None:
    lay = KVCacheLayout.attention(num_layers=32, num_blocks=1000, block_size=16, num_kv_heads=8, head_size=128)
    assert (lay.row_bytes, lay.page_bytes, lay.region_bytes, lay.num_regions) == (512, 65536, 65536000, 32)
    assert lay.total_bytes == 32 * 65536000


@pytest.mark.parametrize(
    ("dtype", "row", "page"),
    [("fp8_e4m3", 128, 16 * 16 * 128), ("nvfp4", 72, 16 * 16 * 72), ("int8", 128, 16 * 16 * 128)],
)
def test_quantized_head_groups(dtype: str, row: int, page: int) -> None:
    lay = KVCacheLayout.quantized(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8, head_size=128, dtype=dtype)
    assert (lay.head_groups, lay.entries, lay.row_bytes, lay.page_bytes) == (2, 16, row, page)


def test_mla_and_mamba_sizes() -> None:
    mla = KVCacheLayout.mla(num_layers=61, num_blocks=10, block_size=64, latent_dim=576)
    assert (mla.page_bytes, mla.num_kv_heads) == (64 * 576 * 2, 1)
    mamba = KVCacheLayout.mamba(num_layers=3, num_blocks=10, page_size_bytes=123456)
    assert (mamba.page_bytes, mamba.region_bytes, mamba.num_regions) == (123456, 1234560, 3)


def test_cross_layer_is_one_region_with_block_major_stride() -> None:
    lay = KVCacheLayout.attention(num_layers=4, num_blocks=10, block_size=16, num_kv_heads=8, head_size=128,
                                  cross_layer=True)  # fmt: skip
    assert lay.num_regions == 1
    assert lay.block_stride == 4 * 65536
    assert lay.regions()[0].nbytes == 10 * 4 * 65536
    assert lay.spans(2, 3) == [(3 * 4 * 65536 + 2 * 65536, 65536)]


def test_spans_hnd_head_slice_is_one_span_nhd_is_per_token() -> None:
    hnd = KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=4, head_size=8)
    assert hnd.spans(0, 1, heads=(1, 3)) == [(hnd.page_bytes + 1 * 4 * 32, 2 * 4 * 32)]
    nhd = KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=4, head_size=8, order="NHD")
    assert nhd.spans(0, 0, heads=(1, 3)) == [(t * 128 + 32, 64) for t in range(4)]
    assert nhd.spans(0, 0, tokens=(1, 3)) == [(128, 256)]
    q = KVCacheLayout.quantized(num_layers=1, num_blocks=2, block_size=2, num_kv_heads=2, head_size=4)
    # K head 1 and V head 1 (entries 1 and 3) of an HND page of 4 entries x 2 tokens x 4 bytes
    assert q.spans(0, 0, heads=(1, 2)) == [(8, 8), (24, 8)]


def test_from_tensor_reads_order_from_strides() -> None:
    hnd = torch.empty(10, 8, 16, 256, dtype=torch.bfloat16)
    nhd = torch.empty(10, 16, 8, 256, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert KVCacheLayout.from_tensor(hnd).order is Order.HND
    lay = KVCacheLayout.from_tensor(nhd, total_kv_heads=16)
    assert (lay.order, lay.num_kv_heads, lay.head_size, lay.total_kv_heads) == (Order.NHD, 8, 128, 16)
    cross = torch.empty(10, 4, 8, 16, 256, dtype=torch.float16).permute(1, 0, 2, 3, 4)
    lay = KVCacheLayout.from_tensor(cross)
    assert (lay.cross_layer, lay.num_layers, lay.dtype) == (True, 4, DType.FP16)
    q = torch.empty(10, 16, 16, 72, dtype=torch.uint8)
    lay = KVCacheLayout.from_tensor(q, "quantized", dtype="nvfp4", head_size=128)
    assert (lay.kind, lay.num_kv_heads, lay.row_bytes) == (CacheKind.QUANTIZED, 8, 72)
    assert KVCacheLayout.from_tensor(torch.empty(5, 1, 1, 999, dtype=torch.int8), "mamba").page_bytes == 999
    assert KVCacheLayout.from_tensor(torch.empty(5, 64, 576, dtype=torch.bfloat16), "mla").head_size == 576


def _per_layer(shape: tuple[int, ...], order: str, dtype: torch.dtype) -> torch.Tensor:
    """A blocks-first tensor (B, E, N, C) allocated in physical order HND or NHD."""
    b, e, n, c = shape
    if order == "HND":
        return torch.empty(b, e, n, c, dtype=dtype)
    return torch.empty(b, n, e, c, dtype=dtype).permute(0, 2, 1, 3)


def _cross(layers: int, shape: tuple[int, ...], order: str, dtype: torch.dtype) -> torch.Tensor:
    """(L, B, E, N, C) with the block-major stride order (1, 0, 2, 3, 4)."""
    b, e, n, c = shape
    if order == "HND":
        return torch.empty(b, layers, e, n, c, dtype=dtype).permute(1, 0, 2, 3, 4)
    return torch.empty(b, layers, n, e, c, dtype=dtype).permute(1, 0, 3, 2, 4)


TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_attention_from_numbers_equals_from_tensor(dtype: str, order: str, cross: bool) -> None:
    # 3 blocks, 4 kv heads (of 8 in the model), 16 tokens, head size 64 packed as K|V = 128
    shape = (3, 4, 16, 128)
    tensor = _cross(5, shape, order, TORCH_DTYPES[dtype]) if cross else _per_layer(shape, order, TORCH_DTYPES[dtype])
    got = KVCacheLayout.from_tensor(tensor, total_kv_heads=8)
    want = KVCacheLayout.attention(
        num_layers=5 if cross else 1, num_blocks=3, block_size=16, num_kv_heads=4, head_size=64, dtype=dtype,
        order=order, total_kv_heads=8, cross_layer=cross,
    )  # fmt: skip
    assert got == want
    page = 4 * 16 * 128 * ELEMENT_BYTES[dtype]
    assert (got.row_bytes, got.page_bytes) == (128 * ELEMENT_BYTES[dtype], page)
    assert got.block_stride == tensor.stride(1 if cross else 0) * tensor.element_size() == page * (5 if cross else 1)
    assert got.total_bytes == tensor.numel() * tensor.element_size()
    assert got.num_regions == (1 if cross else got.num_layers)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize(
    ("dtype", "order"),
    [(d, o) for d in ("fp8_e4m3", "fp8_e5m2", "int8", "nvfp4") for o in ("HND", "NHD")],
)
def test_quantized_from_numbers_equals_from_tensor(dtype: str, order: str, cross: bool) -> None:
    # 2 kv heads -> 4 entries (K heads, then V heads); head size 32; nvfp4 rows are 16 + 2 bytes
    row = 18 if dtype == "nvfp4" else 32
    torch_dtype = torch.uint8 if dtype == "nvfp4" else TORCH_DTYPES[dtype]
    shape = (6, 4, 8, row)
    tensor = _cross(3, shape, order, torch_dtype) if cross else _per_layer(shape, order, torch_dtype)
    extra = {"dtype": "nvfp4", "head_size": 32} if dtype == "nvfp4" else {}
    got = KVCacheLayout.from_tensor(tensor, "quantized", **extra)  # type: ignore[arg-type]
    want = KVCacheLayout.quantized(num_layers=3 if cross else 1, num_blocks=6, block_size=8, num_kv_heads=2,
                                   head_size=32, dtype=dtype, order=order, cross_layer=cross)  # fmt: skip
    assert got == want
    assert (got.head_groups, got.entries, got.row_bytes, got.page_bytes) == (2, 4, row, 8 * 4 * row)
    assert got.total_bytes == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_mla_from_numbers_equals_from_tensor(dtype: str, cross: bool) -> None:
    t = (torch.empty(7, 4, 64, 576, dtype=TORCH_DTYPES[dtype]).permute(1, 0, 2, 3) if cross
         else torch.empty(7, 64, 576, dtype=TORCH_DTYPES[dtype]))  # fmt: skip
    got = KVCacheLayout.from_tensor(t, "mla")
    want = KVCacheLayout.mla(num_layers=4 if cross else 1, num_blocks=7, block_size=64, latent_dim=576, dtype=dtype,
                             cross_layer=cross)  # fmt: skip
    assert got == want
    assert (got.num_kv_heads, got.total_kv_heads, got.page_bytes) == (1, 1, 64 * 576 * ELEMENT_BYTES[dtype])
    assert got.total_bytes == t.numel() * t.element_size()


@pytest.mark.parametrize("cross", [False, True])
def test_mamba_from_numbers_equals_from_tensor(cross: bool) -> None:
    per_layer = torch.empty(9, 1, 1, 5000, dtype=torch.int8)
    t = torch.empty(9, 3, 1, 1, 5000, dtype=torch.int8).permute(1, 0, 2, 3, 4) if cross else per_layer
    got = KVCacheLayout.from_tensor(t, "mamba")
    assert got == KVCacheLayout.mamba(num_layers=3 if cross else 1, num_blocks=9, page_size_bytes=5000,
                                      cross_layer=cross)  # fmt: skip
    assert (got.page_bytes, got.block_size, got.num_regions) == (5000, 1, 1)
    assert got.total_bytes == t.numel()


def test_numpy_arrays_are_read_with_byte_strides() -> None:
    arr = np.empty((3, 16, 4, 128), dtype=np.float16).transpose(0, 2, 1, 3)
    lay = KVCacheLayout.from_tensor(arr)
    assert (lay.order, lay.dtype, lay.num_kv_heads, lay.head_size, lay.page_bytes) == (Order.NHD, DType.FP16, 4, 64,
                                                                                        16 * 4 * 256)  # fmt: skip


def test_size_one_dims_accept_any_stride() -> None:
    # One kv head per rank (e.g. 8 heads over TP 8) in NHD: the heads dim has size 1, so NHD and HND
    # are the same bytes whatever its stride says.
    one_head = torch.empty(4, 16, 1, 256, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert one_head.stride() == (4096, 256, 256, 1)
    lay = KVCacheLayout.from_tensor(one_head, total_kv_heads=8)
    assert (lay.num_kv_heads, lay.page_bytes) == (1, 16 * 512)
    one_token = torch.empty(5, 1, 576, dtype=torch.bfloat16).as_strided((5, 1, 576), (576, 0, 1))
    assert KVCacheLayout.from_tensor(one_token, "mla").block_size == 1
    one_block = torch.empty(1, 8, 16, 256).as_strided((1, 8, 16, 256), (0, 4096, 256, 1))
    assert KVCacheLayout.from_tensor(one_block).num_blocks == 1


@pytest.mark.parametrize(
    ("tensor", "kind", "message"),
    [
        (torch.empty(10, 8, 16), "attention",
         "shape: a attention cache tensor has 4 dims (or 5 with a leading layers dim), got 3 dims (10, 8, 16)"),
        (torch.empty(10, 8, 16, 255), "attention", "shape: the last dim packs K and V (2*head_size), got odd 255"),
        (torch.empty(10, 8, 16, 256)[:, :, :, :128], "attention",
         "strides: dim 1 (heads) has stride 4096, the standardized layout needs 2048 "
         "(got strides (4096, 256, 1), expected (2048, 128, 1))"),
        (torch.empty(10, 16, 8, 264)[..., :256].permute(0, 2, 1, 3), "attention",
         "strides: dim 1 (heads) has stride 264, the standardized layout needs 256"),
        (torch.empty(10, 8, 16, 256)[::2], "attention",
         "strides: the blocks dim (dim 0) has stride 65536, the standardized layout needs 32768 (pages of 32768 "
         "elements)"),
        (torch.empty(4, 10, 8, 16, 256), "attention",
         "strides: the blocks dim (dim 1) has stride 32768, the standardized layout needs 131072 (pages of 32768 "
         "elements x 4 layers, block-major)"),
        (torch.empty(10, 4, 8, 16, 256).permute(1, 0, 2, 3, 4)[:, :, :, :, :128], "attention",
         "strides: dim 2 (heads) has stride 4096, the standardized layout needs 2048"),
        (torch.empty(10 * 4 * 32768).as_strided((4, 10, 8, 16, 256), (0, 4 * 32768, 4096, 256, 1)), "attention",
         "strides: a cross-layer cache is block-major (stride order (1, 0, 2, ...)): the layers dim needs stride "
         "32768, got 0"),
        (torch.empty(10, 64, 600)[..., :576], "mla", "strides: dim 1 (tokens) has stride 600, the standardized layout "
         "needs 576"),
        (torch.empty(2, 10, 8, 64, 576), "mla",
         "shape: a mla cache tensor has 3 dims (or 4 with a leading layers dim), got 5 dims"),
        (torch.empty(10, 1, 1, 198, dtype=torch.int8)[..., ::2], "mamba", "strides: dim 3 (page) has stride 2"),
        (torch.empty(10, 2, 1, 99, dtype=torch.int8), "mamba", "shape: a mamba page tensor is (B, 1, 1, page_bytes)"),
        (torch.empty(10, 1, 1, 99, dtype=torch.float16), "mamba", "dtype: a mamba page tensor is int8, got fp16"),
        (torch.empty(10, 7, 16, 8, dtype=torch.uint8), "quantized", "shape: dim 1 of a quantized cache is "
         "2*num_kv_heads, got 7"),
        (torch.empty(10, 8, 16, 8, dtype=torch.bfloat16), "quantized", "dtype: a quantized head-group cache holds "
         "fp8_e4m3, fp8_e5m2, int8, nvfp4, got bf16"),
        (torch.empty(10, 8, 16, 8, dtype=torch.float64), "attention", "dtype: unknown dtype 'float64'"),
    ],
)  # fmt: skip
def test_from_tensor_refuses_non_standard_tensors(tensor: torch.Tensor, kind: str, message: str) -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.from_tensor(tensor, kind)
    assert str(err.value).startswith(message), str(err.value)
    assert err.value.field == message.split(":")[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "head_size: required for an nvfp4 tensor (its last dim is bytes)"),
        ({"head_size": 128, "dtype": "nvfp4"}, "shape: an nvfp4 row of head_size 128 is 72 bytes, last dim is 70"),
        ({"head_size": 120, "dtype": "nvfp4"}, "head_size: nvfp4 needs a multiple of 16, got 120"),
    ],
)
def test_nvfp4_tensor_errors(kwargs: dict[str, object], message: str) -> None:
    t = torch.empty(4, 8, 16, 70, dtype=torch.uint8)
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.from_tensor(t, "quantized", **{"dtype": "nvfp4", **kwargs})  # type: ignore[arg-type]
    assert str(err.value) == message


def test_layouts_are_frozen() -> None:
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=8, head_size=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_blocks = 9  # type: ignore[misc]
    assert hash(lay) == hash(KVCacheLayout.from_dict(lay.to_dict()))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -1}, "block_size"),
        ({"dtype": "fp7"}, "dtype"),
        ({"order": "HDN"}, "order"),
        ({"num_kv_heads": 8, "total_kv_heads": 4}, "num_kv_heads"),
        ({"dtype": "nvfp4"}, "dtype"),
    ],
)
def test_bad_numbers_name_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"num_layers": 2, "num_blocks": 8, "block_size": 16, "num_kv_heads": 8, "head_size": 64}
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.attention(**{**base, **kwargs})  # type: ignore[arg-type]
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_wire_round_trip_and_unknown_keys() -> None:
    lay = KVCacheLayout.quantized(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                  order="NHD", total_kv_heads=8)  # fmt: skip
    assert KVCacheLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(LayoutError, match=r"layout: unknown keys \['heads'\]"):
        KVCacheLayout.from_dict({**lay.to_dict(), "heads": 3})
    with pytest.raises(LayoutError, match=r"layout: missing keys \['dtype'\]"):
        KVCacheLayout.from_dict({k: v for k, v in lay.to_dict().items() if k != "dtype"})


def test_head_range_split_and_replication() -> None:
    assert [head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(LayoutError, match="total_kv_heads: 6 heads cannot be split evenly over tp_size 4"):
        head_range(6, 4, 0)


def test_compatible_layouts_may_differ_in_order_packing_blocks_and_tp() -> None:
    local = KVCacheLayout.attention(num_layers=32, num_blocks=100, block_size=16, num_kv_heads=2, head_size=128,
                                    total_kv_heads=8, order="NHD")  # fmt: skip
    remote = KVCacheLayout.attention(num_layers=32, num_blocks=7, block_size=64, num_kv_heads=8, head_size=128,
                                     total_kv_heads=8, order="HND", cross_layer=True)  # fmt: skip
    assert local.incompatibilities(remote) == []
    assert local.is_compatible(remote)
    assert remote.is_compatible(local)


def test_incompatibilities_give_every_reason_exactly() -> None:
    attn = KVCacheLayout.attention(num_layers=32, num_blocks=10, block_size=16, num_kv_heads=8, head_size=128)
    quant = KVCacheLayout.quantized(num_layers=30, num_blocks=10, block_size=24, num_kv_heads=4, head_size=64,
                                    total_kv_heads=4)  # fmt: skip
    assert attn.incompatibilities(quant) == [
        "kind: local attention, remote quantized",
        "dtype: local bf16, remote fp8_e4m3",
        "num_layers: local 32, remote 30",
        "head_size: local 128, remote 64",
        "total_kv_heads: local 8, remote 4",
        "block_size: local 16, remote 24 (neither is a multiple of the other)",
    ]
    assert not attn.is_compatible(quant)
    mla = KVCacheLayout.mla(num_layers=4, num_blocks=8, block_size=64, latent_dim=576)
    assert mla.incompatibilities(KVCacheLayout.mla(num_layers=4, num_blocks=8, block_size=64, latent_dim=512)) == [
        "latent_dim: local 576, remote 512"
    ]
    mamba = KVCacheLayout.mamba(num_layers=4, num_blocks=8, page_size_bytes=4096)
    assert mamba.incompatibilities(KVCacheLayout.mamba(num_layers=4, num_blocks=8, page_size_bytes=8192)) == [
        "page_size_bytes: local 4096, remote 8192"
    ]
    fp8 = KVCacheLayout.quantized(num_layers=4, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
    e5m2 = KVCacheLayout.quantized(num_layers=4, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                   dtype="fp8_e5m2")  # fmt: skip
    assert fp8.incompatibilities(e5m2) == ["dtype: local fp8_e4m3, remote fp8_e5m2"]


def test_spans_of_every_kind() -> None:
    # nvfp4: rows of 64 data + 8 scale bytes; each side (K, then V: 2 heads x 4 tokens x 72 bytes) holds
    # the data of all its rows, then all their scales
    q = KVCacheLayout.quantized(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=128, dtype="nvfp4")
    assert (q.row_bytes, q.page_bytes) == (72, 4 * 4 * 72)
    base, side = 2 * q.page_bytes, 2 * 4 * 72
    assert q.spans(1, 2, heads=(0, 1)) == [
        (base, 4 * 64), (base + 2 * 4 * 64, 4 * 8), (base + side, 4 * 64), (base + side + 2 * 4 * 64, 4 * 8)
    ]  # fmt: skip
    mla = KVCacheLayout.mla(num_layers=2, num_blocks=3, block_size=4, latent_dim=576, dtype="fp8_e4m3")
    assert mla.spans(0, 1, tokens=(1, 3)) == [(mla.page_bytes + 576, 2 * 576)]
    mamba = KVCacheLayout.mamba(num_layers=3, num_blocks=4, page_size_bytes=1000, cross_layer=True)
    assert mamba.spans(2, 3) == [(3 * 3000 + 2 * 1000, 1000)]
    with pytest.raises(LayoutError, match=r"^block: 4 is not in \[0, 4\)"):
        mamba.spans(0, 4)
    with pytest.raises(LayoutError, match=r"^layer: 3 is not in \[0, 3\)"):
        mamba.spans(3, 0)
    with pytest.raises(LayoutError, match=r"^heads: \(1, 3\) is not a range inside \[0, 2\)"):
        q.spans(0, 0, heads=(1, 3))


# ----------------------------------------------------------------- generalized layouts (vLLM 0.32 stride orders)
NVFP4_ISSUE_SPANS = [(4096, 4096), (8704, 512), (13312, 4096), (17920, 512)]


def test_nvfp4_head_slice_is_data_then_scales_per_side() -> None:
    # The issue's example: 8 heads x 16 tokens, head_size 128: rows of 64 data + 8 scale bytes. The K side
    # (8 x 16 x 72 = 9216 B) holds the data of its 128 rows (8192 B), then their scales; the V side follows.
    q = KVCacheLayout.quantized(num_layers=1, num_blocks=2, block_size=16, num_kv_heads=8, head_size=128, dtype="nvfp4")
    assert (q.row_bytes, q.page_bytes, q.stride_order) == (72, 18432, "LBHNC")
    assert q.spans(0, 0, heads=(4, 8)) == NVFP4_ISSUE_SPANS
    assert q.spans(0, 1, heads=(4, 8)) == [(18432 + o, n) for o, n in NVFP4_ISSUE_SPANS]
    assert q.spans(0, 0, heads=(0, 1)) == [(0, 1024), (8192, 128), (9216, 1024), (9216 + 8192, 128)]
    assert q.spans(0, 0) == [(0, 18432)]
    row = 5 * 16 + 3  # head 5, token 3: its data row and its scale row on each side
    assert q.spans(0, 0, heads=(5, 6), tokens=(3, 4)) == [
        (row * 64, 64), (8192 + row * 8, 8), (9216 + row * 64, 64), (9216 + 8192 + row * 8, 8)
    ]  # fmt: skip
    cross = KVCacheLayout.quantized(num_layers=3, num_blocks=2, block_size=16, num_kv_heads=8, head_size=128,
                                    dtype="nvfp4", cross_layer=True)  # fmt: skip
    assert cross.stride_order == "BLHNC"
    assert cross.spans(2, 1, heads=(4, 8)) == [((3 + 2) * 18432 + o, n) for o, n in NVFP4_ISSUE_SPANS]


def test_nvfp4_kernel_blocks_split_each_kernel_page() -> None:
    # block 32 in kernel blocks of 16: each kernel page is an nvfp4 page of its own (sides, data, scales)
    q = KVCacheLayout.quantized(num_layers=1, num_blocks=2, block_size=32, num_kv_heads=8, head_size=128,
                                dtype="nvfp4", kernel_block_size=16)  # fmt: skip
    assert (q.page_bytes, q.block_stride) == (2 * 18432, 2 * 18432)
    assert q.spans(0, 1, heads=(4, 8)) == [(2 * 18432 + k * 18432 + o, n) for k in (0, 1) for o, n in NVFP4_ISSUE_SPANS]


@pytest.mark.parametrize("kwargs", [{"heads_outer": True}, {"heads_outer": True, "cross_layer": True}])
def test_nvfp4_heads_outer_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.quantized(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
                                dtype="nvfp4", **kwargs)  # type: ignore[arg-type]  # fmt: skip
    assert err.value.field == "order"
    name = "BHLNC" if kwargs.get("cross_layer") else "LHBNC"
    assert str(err.value) == (
        "order: nvfp4 keeps each side's data rows and then its scale rows inside a page (LBHNC, LBNHC, BLHNC or "
        f"BLNHC); {name} does not describe where they are"
    )


def test_nvfp4_nhd_rows_are_token_major_per_side() -> None:
    # FlashInfer's _nvfp4_kv_views on an NHD page: per side the data of row (token t, head h) at
    # (t * H + h) * 32, then the scales at H * N * 32 + (t * H + h) * 4 (head_size 64: 32 + 4 bytes).
    q = KVCacheLayout.quantized(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=2, head_size=64,
                                dtype="nvfp4", order="NHD")  # fmt: skip
    side = 2 * 4 * 36
    offs, lens = q.row_offsets(np.array([1]), np.array([2]))
    assert offs.tolist() == [(2 * 2 + 1) * 32, 8 * 32 + (2 * 2 + 1) * 4, side + (2 * 2 + 1) * 32,
                             side + 8 * 32 + (2 * 2 + 1) * 4]  # fmt: skip
    assert lens.tolist() == [32, 4, 32, 4]
    # every head of a token range is one span per part and side
    assert q.spans(0, 1, tokens=(1, 3)) == [
        (2 * side + o, n) for o, n in ((64, 128), (256 + 8, 16), (side + 64, 128), (side + 256 + 8, 16))
    ]


def test_nvfp4_nhd_tensor_is_read() -> None:
    nhd = torch.empty(4, 16, 4, 36, dtype=torch.uint8).permute(0, 2, 1, 3)  # (B, 2H, N, 36) stored token-major
    lay = KVCacheLayout.from_tensor(nhd, "quantized", dtype="nvfp4", head_size=64)
    assert (lay.order, lay.num_kv_heads, lay.block_size, lay.row_bytes) == (Order.NHD, 2, 16, 36)


@pytest.mark.parametrize(
    ("order", "cross", "heads_outer", "name"),
    [("HND", False, False, "LBHNC"), ("NHD", False, False, "LBNHC"), ("HND", False, True, "LHBNC"),
     ("HND", True, False, "BLHNC"), ("NHD", True, False, "BLNHC"), ("HND", True, True, "BHLNC")],
)  # fmt: skip
def test_stride_order_names(order: str, cross: bool, heads_outer: bool, name: str) -> None:
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64, order=order,
                                  cross_layer=cross, heads_outer=heads_outer)  # fmt: skip
    assert lay.stride_order == name
    assert lay.total_bytes == 2 * 4 * lay.page_bytes
    assert lay.num_regions == (1 if cross else 2)


def test_lhbnc_puts_each_heads_blocks_together() -> None:
    # per layer [H, B, N, C]: head h of block b at (h * 10 + b) * 4096 (a head's block is 16 rows of 256 B)
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=10, block_size=16, num_kv_heads=4, head_size=64,
                                  heads_outer=True)  # fmt: skip
    assert (lay.page_bytes, lay.block_stride, lay.region_bytes, lay.num_regions) == (16384, 4096, 163840, 2)
    assert lay.spans(1, 3) == [((h * 10 + 3) * 4096, 4096) for h in range(4)]
    assert lay.spans(1, 3, heads=(1, 3)) == [(13 * 4096, 4096), (23 * 4096, 4096)]
    assert lay.spans(0, 3, heads=(2, 3), tokens=(4, 6)) == [(23 * 4096 + 4 * 256, 2 * 256)]


def test_bhlnc_puts_a_blocks_heads_outside_its_layers() -> None:
    # one region [B, H, L, N, C]: (block b, head h, layer l) at ((b * 4 + h) * 2 + l) * 4096
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=10, block_size=16, num_kv_heads=4, head_size=64,
                                  heads_outer=True, cross_layer=True)  # fmt: skip
    assert (lay.block_stride, lay.layer_stride, lay.region_bytes, lay.num_regions) == (32768, 4096, 327680, 1)
    assert lay.spans(1, 3) == [(((3 * 4 + h) * 2 + 1) * 4096, 4096) for h in range(4)]


def test_padded_pages_keep_padding_out_of_every_span() -> None:
    pad = KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                  page_stride=12288)  # fmt: skip
    assert (pad.page_bytes, pad.block_stride, pad.region_bytes) == (8192, 12288, 8 * 12288)
    assert pad.spans(1, 3) == [(3 * 12288, 8192)]
    assert pad.spans(1, 3, heads=(1, 2)) == [(3 * 12288 + 4096, 4096)]
    cross = KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                    page_stride=12288, cross_layer=True)  # fmt: skip
    assert (cross.block_stride, cross.layer_stride, cross.region_bytes) == (2 * 12288, 12288, 8 * 2 * 12288)
    assert cross.spans(1, 3) == [((3 * 2 + 1) * 12288, 8192)]
    mamba = KVCacheLayout.mamba(num_layers=2, num_blocks=4, page_size_bytes=1000, page_stride=1024)
    assert (mamba.page_bytes, mamba.block_stride, mamba.region_bytes) == (1000, 1024, 4096)
    assert mamba.spans(1, 2) == [(2048, 1000)]
    mla = KVCacheLayout.mla(num_layers=1, num_blocks=4, block_size=4, latent_dim=8, page_stride=100)
    assert (mla.page_bytes, mla.region_bytes, mla.spans(0, 3)) == (64, 400, [(300, 64)])


def test_a_block_major_block_may_be_longer_than_its_layers() -> None:
    # vLLM's block-outermost cache of two groups: every block is the larger group's (3 pages); this
    # group has 1 layer, so each block is its page and 2 pages of another group's bytes.
    lay = KVCacheLayout.attention(num_layers=1, num_blocks=5, block_size=16, num_kv_heads=2, head_size=64,
                                  cross_layer=True, block_bytes=3 * 8192)  # fmt: skip
    assert (lay.page_bytes, lay.block_stride, lay.layer_stride) == (8192, 3 * 8192, 8192)
    assert lay.region_bytes == 4 * 3 * 8192 + 8192  # the last block ends with its own page
    assert lay.spans(0, 4) == [(4 * 3 * 8192, 8192)]
    bhlnc = KVCacheLayout.attention(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64,
                                    cross_layer=True, heads_outer=True, block_bytes=5 * 8192)  # fmt: skip
    # [B, H, L, N, C] inside a block of 5 pages: (head h, layer l) at (h * 2 + l) * 4096
    assert bhlnc.spans(1, 2) == [(2 * 5 * 8192 + 4096, 4096), (2 * 5 * 8192 + 3 * 4096, 4096)]
    assert bhlnc.region_bytes == 2 * 5 * 8192 + 2 * 8192
    # The block of the group's own pages is the canonical 0, so equal geometry compares equal.
    plain = KVCacheLayout.attention(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_size=64,
                                    cross_layer=True)  # fmt: skip
    assert dataclasses.replace(plain, block_bytes=2 * 8192) == plain
    assert dataclasses.replace(plain, block_bytes=2 * 8192).block_bytes == 0


def test_one_slot_kinds_have_no_head_axis_to_put_outside() -> None:
    mla = KVCacheLayout.mla(num_layers=2, num_blocks=4, block_size=4, latent_dim=8, page_stride=100)
    assert dataclasses.replace(mla, heads_outer=True) == mla  # LHBNC of one slot: LBHNC's bytes
    mamba = KVCacheLayout.mamba(num_layers=2, num_blocks=4, page_size_bytes=1000, page_stride=1024, cross_layer=True)
    assert dataclasses.replace(mamba, heads_outer=True).stride_order == "BLHNC"


def test_kernel_blocks_are_full_pages_one_after_another() -> None:
    # block 32 = kernel blocks of 16 tokens, each an HND page of 2 heads x 16 rows x 256 B = 8192 B
    lay = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=32, num_kv_heads=2, head_size=64,
                                  kernel_block_size=16)  # fmt: skip
    assert (lay.page_bytes, lay.block_stride, lay.kernel_blocks_per_block) == (16384, 16384, 2)
    assert lay.spans(0, 1) == [(16384, 16384)]
    assert lay.spans(0, 1, heads=(1, 2)) == [(16384 + 4096, 4096), (16384 + 8192 + 4096, 4096)]
    # tokens 8..24: rows 8..15 of each head in kernel block 0, rows 0..7 in kernel block 1 (head 1 of the
    # first and head 0 of the second are adjacent)
    assert lay.spans(0, 1, tokens=(8, 24)) == [(18432, 2048), (22528, 4096), (28672, 2048)]
    nhd = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=32, num_kv_heads=2, head_size=64,
                                  kernel_block_size=16, order="NHD")  # fmt: skip
    assert nhd.spans(0, 0, heads=(1, 2), tokens=(15, 17)) == [(15 * 512 + 256, 256), (8192 + 256, 256)]


def test_head_size_v_packs_k_then_a_v_of_its_own_size() -> None:
    lay = KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                                  head_size_v=64)  # fmt: skip
    assert (lay.row_bytes, lay.page_bytes) == ((128 + 64) * 2, 16 * 8 * 384)
    assert lay.spans(0, 1, heads=(2, 4)) == [(lay.page_bytes + 2 * 16 * 384, 2 * 16 * 384)]
    nhd = KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                                  head_size_v=64, order="NHD")  # fmt: skip
    assert nhd.spans(0, 0, heads=(2, 4)) == [(t * 8 * 384 + 2 * 384, 2 * 384) for t in range(16)]
    same = KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8, head_size=128,
                                   head_size_v=128)  # fmt: skip
    assert same == KVCacheLayout.attention(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)


def test_kv_planes_sizes_and_head_slices() -> None:
    # bf16, 4 of 8 heads, head_size 64: a plane row holds 4 heads x 128 B; a block is a K plane then a V plane
    lay = KVCacheLayout.kv_planes(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=4, head_size=64,
                                  total_kv_heads=8)  # fmt: skip
    assert (lay.slots, lay.row_bytes, lay.page_bytes) == (2, 512, 2 * 16 * 512)
    assert lay.spans(0, 1) == [(16384, 16384)]
    assert lay.spans(0, 1, heads=(1, 3)) == [(16384 + p * 8192 + t * 512 + 128, 256) for p in (0, 1) for t in range(16)]
    nhd = KVCacheLayout.kv_planes(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=4, head_size=64,
                                  order="NHD")  # fmt: skip
    assert nhd.stride_order == "LBNHC"
    assert nhd.spans(0, 0, heads=(1, 3)) == [(t * 1024 + p * 512 + 128, 256) for t in range(16) for p in (0, 1)]


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_kv_planes_from_numbers_equals_from_tensor(order: str, cross: bool) -> None:
    shape = (5, 2, 16, 4 * 64)  # (B, 2 planes, N, 4 heads x head_size 64)
    tensor = _cross(3, shape, order, torch.bfloat16) if cross else _per_layer(shape, order, torch.bfloat16)
    got = KVCacheLayout.from_tensor(tensor, "kv_planes", head_size=64, total_kv_heads=8)
    assert got == KVCacheLayout.kv_planes(num_layers=3 if cross else 1, num_blocks=5, block_size=16, num_kv_heads=4,
                                          head_size=64, total_kv_heads=8, order=order, cross_layer=cross)  # fmt: skip
    assert got.total_bytes == tensor.numel() * tensor.element_size()


BASE = {"num_layers": 2, "num_blocks": 8, "block_size": 16, "num_kv_heads": 8, "head_size": 128}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"order": "NHD", "heads_outer": True},
         "heads_outer: only the HND orders put heads outside the blocks (LHBNC, BHLNC)"),
        ({"order": "NHD", "heads_outer": True, "cross_layer": True},
         "heads_outer: only the HND orders put heads outside the blocks (LHBNC, BHLNC)"),
        ({"page_stride": 100}, "page_stride: 100 bytes is less than a page of 65536 bytes"),
        ({"page_stride": -1}, "page_stride: must be an integer >= 0, got -1"),
        ({"kernel_block_size": 5}, "kernel_block_size: 5 does not divide block_size 16"),
        ({"kernel_block_size": 32}, "kernel_block_size: 32 does not divide block_size 16"),
        ({"page_stride": 70000, "kernel_block_size": 8},
         "page_stride: padded pages must be whole blocks (vLLM pads only LBHNC/LBNHC/BLHNC/BLNHC pages that are not "
         "split into kernel blocks)"),
        ({"page_stride": 70000, "heads_outer": True},
         "page_stride: padded pages must be whole blocks (vLLM pads only LBHNC/LBNHC/BLHNC/BLNHC pages that are not "
         "split into kernel blocks)"),
        ({"page_stride": 70000, "heads_outer": True, "cross_layer": True},
         "page_stride: padded pages must be whole blocks"),
        ({"head_size_v": -2}, "head_size_v: must be an integer >= 0, got -2"),
        ({"block_bytes": 200000},
         "block_bytes: 200000 describes a block-major region (BLHNC, BLNHC, BHLNC); a region per layer (LBHNC) has "
         "no block of all layers"),
        ({"block_bytes": 100, "cross_layer": True},
         "block_bytes: 100 is less than the 2 layers' pages of a block (131072 bytes)"),
        ({"block_bytes": 200000, "cross_layer": True, "kernel_block_size": 8},
         "block_bytes: a block-major region of kernel blocks has no slack between blocks"),
        ({"block_bytes": -1}, "block_bytes: must be an integer >= 0, got -1"),
        ({"heads_outer": 1}, "heads_outer: must be a bool, got 1"),
    ],
)  # fmt: skip
def test_invalid_geometry_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.attention(**{**BASE, **kwargs})  # type: ignore[arg-type]
    assert str(err.value).startswith(message), str(err.value)
    assert err.value.field == message.split(":")[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "quantized", "dtype": "int8", "head_size_v": 64},
         "head_size_v: quantized caches keep K and V of one size (vLLM asserts it), got head_size 128, head_size_v 64"),
        ({"kind": "kv_planes", "dtype": "bf16", "head_size_v": 64},
         "head_size_v: kv_planes caches keep K and V of one size (vLLM asserts it), got head_size 128, "
         "head_size_v 64"),
        ({"kind": "mla", "dtype": "bf16", "num_kv_heads": 1, "head_size_v": 64},
         "head_size_v: a mla cache has no separate V, got 64"),
        ({"kind": "kv_planes", "dtype": "nvfp4"}, "dtype: nvfp4 is only defined for quantized head-group caches, not "
         "kv_planes"),
        ({"kind": "attention", "dtype": "nvfp4"}, "dtype: nvfp4 is only defined for quantized head-group caches, not "
         "attention"),
        ({"kind": "quantized", "dtype": "nvfp4", "head_size": 120}, "head_size: nvfp4 needs a multiple of 16, got 120"),
        ({"kind": "mamba", "dtype": "int8", "num_kv_heads": 1, "block_size": 4},
         "block_size: a mamba page has no token axis; use block_size=1, got 4"),
    ],
)  # fmt: skip
def test_invalid_kind_combinations_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout(**{**BASE, **kwargs})  # type: ignore[arg-type]
    assert str(err.value) == message
    assert err.value.field == message.split(":")[0]


def test_new_fields_survive_the_wire_and_pickle() -> None:
    layouts = [
        KVCacheLayout.attention(num_layers=2, num_blocks=4, block_size=32, num_kv_heads=2, head_size=64, head_size_v=32,
                                heads_outer=True, cross_layer=True, kernel_block_size=16),
        KVCacheLayout.attention(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
                                page_stride=20000, order="NHD"),
        KVCacheLayout.kv_planes(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64,
                                kernel_block_size=8),
        KVCacheLayout.quantized(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64, dtype="nvfp4",
                                cross_layer=True),
    ]  # fmt: skip
    for lay in layouts:
        back = KVCacheLayout.from_dict(lay.to_dict())
        assert back == lay
        assert (back.stride_order, back.block_stride, back.region_bytes) == (
            lay.stride_order, lay.block_stride, lay.region_bytes)  # fmt: skip
        assert back.spans(1, 3, heads=(1, 2)) == lay.spans(1, 3, heads=(1, 2))
        again = pickle.loads(pickle.dumps(lay))
        assert again == lay
        assert again.spans(1, 3, heads=(1, 2)) == lay.spans(1, 3, heads=(1, 2))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "attention", "dtype": "bfloat16", "packing": "cpu_kt"},
        {"kind": "attention", "dtype": "bfloat16", "packing": "head_block"},
        {"kind": "quantized", "dtype": "nvfp4"},
        {"kind": "quantized", "dtype": "nvfp4", "cross_layer": True},
    ],
)
def test_heads_outer_in_an_nhd_order_is_refused_by_name_whatever_else_is_off(kwargs: dict[str, object]) -> None:
    """These raised KeyError (a check of the packing or of nvfp4 named a stride order the combination has not)."""
    with pytest.raises(LayoutError) as err:
        KVCacheLayout(**{**BASE, "order": "NHD", "heads_outer": True, **kwargs})  # type: ignore[arg-type]
    assert err.value.field == "heads_outer"
    assert str(err.value) == "heads_outer: only the HND orders put heads outside the blocks (LHBNC, BHLNC)"


@given(
    kind=st.sampled_from(CacheKind), order=st.sampled_from(Order), packing=st.sampled_from(Packing),
    dtype=st.sampled_from(DType), cross_layer=st.booleans(), heads_outer=st.booleans(),
    block_size=st.sampled_from([1, 16]), num_kv_heads=st.sampled_from([1, 2]), head_size=st.sampled_from([16, 24]),
    kernel_block_size=st.sampled_from([0, 8]), page_stride=st.sampled_from([0, 1 << 20]),
    block_bytes=st.sampled_from([0, 1 << 22]),
)  # fmt: skip
def test_any_combination_of_fields_is_a_layout_or_a_layout_error(**fields: object) -> None:
    """Whatever the fields, the constructor answers with a layout or a LayoutError naming one of them, never
    another exception (a KeyError escaped for heads_outer in an NHD order)."""
    refused: LayoutError | None = None
    try:
        layout = KVCacheLayout(num_layers=2, num_blocks=4, **fields)  # type: ignore[arg-type]
    except LayoutError as err:
        refused = err
    if refused is not None:
        assert refused.field in {f.name for f in dataclasses.fields(KVCacheLayout)}, (refused.field, str(refused))
        return
    assert layout.total_bytes > 0
    assert layout.stride_order  # every layout that exists has a name in vLLM's terms
