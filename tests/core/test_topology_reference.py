"""Property tests: descriptors from TransferTopology move exactly the bytes a naive model moves."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo, RegionTable, TransferPlan, TransferTopology

from .reference import Side, apply_descriptors, expected_after_pull, fill_remote, heads_of_rank, logical_values


@dataclass(frozen=True)
class Case:
    kind: str
    dtype: str
    layers: int
    total_heads: int
    head_size: int
    local_tp: int
    local_rank: int
    remote_tp: int
    local_tokens: int
    remote_tokens: int
    local_blocks_n: int
    remote_blocks_n: int
    local_order: str
    remote_order: str
    local_cross: bool
    remote_cross: bool
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


def _block_list(draw: st.DrawFn, n_avail: int, m: int) -> tuple[int, ...]:
    style = draw(st.sampled_from(["contiguous", "reversed", "random", "sorted", "fragmented"]))
    if style in ("contiguous", "reversed"):
        start = draw(st.integers(0, n_avail - m))
        ids = list(range(start, start + m))
        return tuple(ids[::-1] if style == "reversed" else ids)
    if style == "fragmented":
        # runs of 1..3 consecutive ids, the runs in random order
        perm = draw(st.permutations(range(n_avail)))
        out: list[int] = []
        for first in perm:
            run = [b for b in range(first, first + draw(st.integers(1, 3))) if b < n_avail and b not in out]
            out.extend(run[: m - len(out)])
            if len(out) == m:
                break
        return tuple(out)
    perm = draw(st.permutations(range(n_avail)))
    chosen = list(perm[:m])
    return tuple(sorted(chosen) if style == "sorted" else chosen)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["attention", "quantized", "mla", "mamba"]))
    if kind == "attention":
        dtype = draw(st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"]))
        head_size = draw(st.sampled_from([1, 2, 4]))
    elif kind == "quantized":
        dtype = draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "int8", "nvfp4"]))
        head_size = draw(st.sampled_from([16, 32] if dtype == "nvfp4" else [2, 4, 8]))
    elif kind == "mla":
        dtype = draw(st.sampled_from(["bf16", "fp16", "fp8_e4m3"]))
        head_size = draw(st.sampled_from([3, 8]))
    else:
        dtype, head_size = "int8", draw(st.sampled_from([1, 7, 64]))
    total_heads = draw(st.sampled_from([1, 2, 4, 8])) if kind in ("attention", "quantized") else 1
    local_tp = draw(st.sampled_from([1, 2, 4, 8]))
    remote_tp = local_tp if kind == "mamba" else draw(st.sampled_from([1, 2, 4, 8]))
    local_rank = draw(st.integers(0, local_tp - 1))
    if kind == "mamba":
        local_tokens = remote_tokens = 1
    else:
        local_tokens = draw(st.sampled_from([1, 2, 4, 8]))
        ratio = draw(st.sampled_from([1, 2, 4]))
        remote_tokens = local_tokens * ratio if draw(st.booleans()) else max(1, local_tokens // ratio)
    local_blocks_n = draw(st.integers(4, 16))
    remote_blocks_n = draw(st.integers(4, 16))
    big = max(local_tokens, remote_tokens)
    max_c = min(local_blocks_n * local_tokens, remote_blocks_n * remote_tokens) // big
    c = draw(st.integers(1, max(1, max_c)))
    tokens = c * big
    orders = ["HND", "NHD"] if kind in ("attention", "quantized") else ["HND"] if kind == "mamba" else ["NHD"]
    return Case(
        kind=kind,
        dtype=dtype,
        layers=draw(st.integers(1, 3)),
        total_heads=total_heads,
        head_size=head_size,
        local_tp=local_tp,
        local_rank=local_rank,
        remote_tp=remote_tp,
        local_tokens=local_tokens,
        remote_tokens=remote_tokens,
        local_blocks_n=local_blocks_n,
        remote_blocks_n=remote_blocks_n,
        local_order=draw(st.sampled_from(orders)),
        remote_order=draw(st.sampled_from(orders)),
        local_cross=draw(st.booleans()),
        remote_cross=draw(st.booleans()),
        local_blocks=_block_list(draw, local_blocks_n, tokens // local_tokens),
        remote_blocks=_block_list(draw, remote_blocks_n, tokens // remote_tokens),
    )


def _layout(case: Case, local: bool, heads: int) -> KVCacheLayout:
    common = {
        "num_layers": case.layers,
        "num_blocks": case.local_blocks_n if local else case.remote_blocks_n,
        "cross_layer": case.local_cross if local else case.remote_cross,
    }
    tokens = case.local_tokens if local else case.remote_tokens
    order = case.local_order if local else case.remote_order
    if case.kind == "mla":
        return KVCacheLayout.mla(block_size=tokens, latent_dim=case.head_size, dtype=case.dtype, **common)
    if case.kind == "mamba":
        return KVCacheLayout.mamba(page_size_bytes=case.head_size, **common)
    ctor = KVCacheLayout.attention if case.kind == "attention" else KVCacheLayout.quantized
    return ctor(
        block_size=tokens, num_kv_heads=heads, head_size=case.head_size, dtype=case.dtype, order=order,
        total_kv_heads=case.total_heads, **common,
    )  # fmt: skip


def _side(case: Case, local: bool, tp: int, rank: int) -> Side:
    h0, h1 = heads_of_rank(case.total_heads, tp, rank)
    return Side(
        kind=case.kind,
        dtype=case.dtype,
        layers=case.layers,
        blocks=case.local_blocks_n if local else case.remote_blocks_n,
        tokens=case.local_tokens if local else case.remote_tokens,
        heads=h1 - h0,
        head_start=h0,
        head_size=case.head_size,
        order=case.local_order if local else case.remote_order,
        cross=case.local_cross if local else case.remote_cross,
        rank=rank,
    )


def run_case(case: Case) -> TransferPlan:
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    local_side = _side(case, True, case.local_tp, case.local_rank)
    remote_sides = [_side(case, False, case.remote_tp, q) for q in range(case.remote_tp)]
    values = logical_values(rng, remote_sides[0], case.total_heads, case.remote_tp)
    remote_bufs = []
    for side in remote_sides:
        buf = rng.integers(0, 256, size=side.buffer_bytes(), dtype=np.uint8)
        fill_remote(side, values, buf)
        remote_bufs.append(buf)
    local_buf = rng.integers(0, 256, size=local_side.buffer_bytes(), dtype=np.uint8)
    lb, rb = np.array(case.local_blocks), np.array(case.remote_blocks)
    expected = expected_after_pull(local_side, local_buf, values, lb, rb, case.remote_tokens)

    local_layout = _layout(case, True, local_side.heads)
    remote_layout = _layout(case, False, remote_sides[0].heads)
    assert local_layout.page_bytes == local_side.page
    assert remote_layout.page_bytes == remote_sides[0].page
    topo = TransferTopology(local_layout, remote_layout, RankInfo(case.local_rank, case.local_tp), case.remote_tp)
    plan = topo.plan(lb, rb)
    local_table = RegionTable.for_layout(local_layout, local_side.bases())
    written = np.zeros(local_buf.size, dtype=np.int32)
    for rp in plan.per_rank:
        table = RegionTable.for_layout(remote_layout, remote_sides[rp.remote_rank].bases())
        ldesc, rdesc = rp.descriptors(local_table, table)
        assert ldesc.dtype == np.uint64
        assert ldesc.shape == (rp.num_descriptors, 3)
        for a, n, _ in ldesc.tolist():
            written[a : a + n] += 1
        apply_descriptors(local_buf, remote_bufs[rp.remote_rank], ldesc, rdesc)
    assert written.max() <= 1, "two descriptors write the same local byte"
    assert plan.total_bytes == len(lb) * case.layers * local_side.page
    np.testing.assert_array_equal(local_buf, expected)
    return plan


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_descriptors_match_naive_model(case: Case) -> None:
    run_case(case)


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "order"),
    [(1, 1, "HND"), (2, 1, "HND"), (1, 2, "HND"), (4, 2, "NHD"), (2, 4, "NHD"), (8, 1, "HND"), (1, 8, "NHD")],
)
def test_every_decode_rank_of_a_tp_pair(local_tp: int, remote_tp: int, order: str) -> None:
    for rank in range(local_tp):
        run_case(
            Case(
                kind="attention",
                dtype="bf16",
                layers=2,
                total_heads=4,
                head_size=2,
                local_tp=local_tp,
                local_rank=rank,
                remote_tp=remote_tp,
                local_tokens=4,
                remote_tokens=8,
                local_blocks_n=8,
                remote_blocks_n=6,
                local_order=order,
                remote_order=order,
                local_cross=False,
                remote_cross=True,
                local_blocks=(7, 0, 1, 2),
                remote_blocks=(5, 0),
            )
        )
