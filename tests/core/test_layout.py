"""KVCacheLayout: sizes, spans, tensors in, and errors that name what is off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvxfer.errors import LayoutError
from kvxfer.layout import CacheKind, DType, KVCacheLayout, Order, head_range


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
@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "int8", "nvfp4"])
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
    # nvfp4: rows of 64 data + 8 scale bytes; V head h is entry heads + h
    q = KVCacheLayout.quantized(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_size=128, dtype="nvfp4")
    assert (q.row_bytes, q.page_bytes) == (72, 4 * 4 * 72)
    assert q.spans(1, 2, heads=(0, 1)) == [(2 * q.page_bytes, 4 * 72), (2 * q.page_bytes + 2 * 4 * 72, 4 * 72)]
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
