"""Every field of a layout crosses the wire: a field the proto lacks would silently read as its default."""

from __future__ import annotations

import dataclasses

import pytest

from kvxfer.errors import InvalidArgumentError
from kvxfer.layout import KVCacheLayout
from kvxfer.wire.convert import layout_from_proto, layout_to_proto

LAYOUTS = [
    KVCacheLayout.attention(num_layers=3, num_blocks=9, block_size=32, num_kv_heads=2, head_size=64, dtype="fp16",
                            total_kv_heads=8, head_size_v=32, packing="cpu_kt", kernel_block_size=16),
    KVCacheLayout.attention(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=8,
                            heads_outer=True, cross_layer=True, packing="head_block"),
    KVCacheLayout.attention(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=8,
                            cross_layer=True, block_bytes=2 * 16 * 4 * 16 * 2 + 512),
    KVCacheLayout.attention(num_layers=2, num_blocks=5, block_size=16, num_kv_heads=4, head_size=8, order="NHD",
                            page_stride=4096 + 128),
    KVCacheLayout.quantized(num_layers=1, num_blocks=3, block_size=16, num_kv_heads=8, head_size=128, dtype="nvfp4"),
    KVCacheLayout.kv_planes(num_layers=1, num_blocks=3, block_size=16, num_kv_heads=4, head_size=64),
    KVCacheLayout.mla(num_layers=4, num_blocks=7, block_size=16, latent_dim=656, dtype="int8", page_stride=16 * 704),
    KVCacheLayout.mamba(num_layers=2, num_blocks=6, page_size_bytes=36032, page_stride=49152),
    KVCacheLayout.mamba(num_layers=2, num_blocks=6, page_size_bytes=3 * 2 * (64 + 16 + 16) + 8 * 16 * 4,
                        page_stride=4096, segments=(384, 96, 96, 512)),
    KVCacheLayout.mamba(num_layers=1, num_blocks=6, page_size_bytes=640, replicated=True),
]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.kind}-{lay.stride_order}")
def test_a_layout_round_trips_through_its_proto(layout: KVCacheLayout) -> None:
    assert layout_from_proto(layout_to_proto(layout), "layout") == layout


def test_every_layout_field_has_a_proto_field() -> None:
    proto_fields = {f.name for f in layout_to_proto(LAYOUTS[0]).DESCRIPTOR.fields}
    assert {f.name for f in dataclasses.fields(KVCacheLayout)} <= proto_fields
    # and every non-default value of the examples is set somewhere, so the round trip above covers it
    for f in dataclasses.fields(KVCacheLayout):
        assert any(getattr(lay, f.name) != f.default for lay in LAYOUTS if f.default is not dataclasses.MISSING) or (
            f.default is dataclasses.MISSING
        ), f.name


def test_a_mamba_split_that_does_not_fill_the_page_is_refused_naming_the_field() -> None:
    msg = layout_to_proto(LAYOUTS[-2])
    del msg.segments[-1]
    with pytest.raises(InvalidArgumentError) as err:
        layout_from_proto(msg, "info.groups[g1].layout")
    assert err.value.field == "info.groups[g1].layout.segments"
    assert str(err.value) == (
        "info.groups[g1].layout.segments: [384, 96, 96] sum to 576 bytes, the mamba page holds page_size_bytes=1088"
    )
    msg.segments.extend([1] * 20)
    with pytest.raises(InvalidArgumentError) as err:
        layout_from_proto(msg, "layout")
    assert str(err.value) == "layout.segments: 23 segments, at most 16"
