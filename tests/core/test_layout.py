"""KVCacheLayout: sizes, spans, tensors in, and errors that name what is off."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("tensor", "kind", "message"),
    [
        (torch.empty(10, 8, 16), "attention", "shape: a attention cache tensor has 4 dims"),
        (torch.empty(10, 8, 16, 255), "attention", "shape: the last dim packs K and V (2*head_size), got odd 255"),
        (torch.empty(10, 8, 16, 256)[:, :, :, :128], "attention", "strides: dim 1 (heads) has stride 4096"),
        (torch.empty(10, 8, 16, 256)[::2], "attention", "strides: the blocks dim has stride 65536"),
        (torch.empty(4, 10, 8, 16, 256), "attention", "strides: the blocks dim has stride 32768"),
        (torch.empty(10, 2, 1, 99, dtype=torch.int8), "mamba", "shape: a mamba page tensor is (B, 1, 1, page_bytes)"),
        (torch.empty(10, 1, 1, 99, dtype=torch.float16), "mamba", "dtype: a mamba page tensor is int8"),
        (torch.empty(10, 7, 16, 8, dtype=torch.uint8), "quantized", "shape: dim 1 of a quantized cache"),
        (torch.empty(10, 8, 16, 8, dtype=torch.bfloat16), "quantized", "dtype: a quantized head-group cache holds"),
    ],
)
def test_from_tensor_refuses_non_standard_tensors(tensor: torch.Tensor, kind: str, message: str) -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.from_tensor(tensor, kind)
    assert str(err.value).startswith(message)


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
