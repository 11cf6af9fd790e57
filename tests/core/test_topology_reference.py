"""Property tests: descriptors from TransferTopology move exactly the bytes a naive model moves."""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo, RegionTable, TransferPlan, TransferTopology

from .reference import (
    NVFP4_ORDERS,
    PADDABLE_ORDERS,
    STRIDE_ORDERS,
    Side,
    apply_descriptors,
    byte_map,
    check_side,
    expected_after_pull,
    fill_remote,
    heads_of_rank,
    logical_values,
)

# kvxfer's spelling of each stride order: (order, cross_layer, heads_outer)
ORDER_FIELDS = {
    "LBHNC": ("HND", False, False),
    "LBNHC": ("NHD", False, False),
    "LHBNC": ("HND", False, True),
    "BLHNC": ("HND", True, False),
    "BLNHC": ("NHD", True, False),
    "BHLNC": ("HND", True, True),
}


@dataclass(frozen=True)
class SideCase:
    """One side's own choices (everything that may differ between two compatible sides)."""

    tokens: int  # block_size
    blocks_n: int  # blocks in the cache
    stride_order: str
    pad: int = 0  # page_stride - page_bytes (0: no padding)
    kernel: int = 0  # kernel_block_size (0: no splitting)
    slack: int = 0  # block-major orders: block_bytes - the block's own bytes (0: none)


@dataclass(frozen=True)
class Case:
    kind: str
    dtype: str
    layers: int
    total_heads: int
    head_size: int
    head_size_v: int
    local_tp: int
    local_rank: int
    remote_tp: int
    local: SideCase
    remote: SideCase
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    segments: tuple[int, ...] = ()  # mamba: the global byte size of each TP segment (head_size unused)
    replicated: bool = False  # mamba: every rank holds the whole state


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


def _orders(kind: str, dtype: str) -> list[str]:
    """Stride orders each constructor can describe for this kind."""
    if dtype == "nvfp4":
        return list(NVFP4_ORDERS)
    if kind == "mamba":
        return ["LBHNC", "BLHNC"]
    if kind == "mla":
        return ["LBNHC", "BLNHC"]
    if kind == "kv_planes":
        return ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
    return list(STRIDE_ORDERS)


def _side_case(draw: st.DrawFn, kind: str, dtype: str, tokens: int) -> SideCase:
    order = draw(st.sampled_from(_orders(kind, dtype)))
    kernel = 0
    if kind != "mamba" and tokens > 1 and draw(st.booleans()):
        kernel = draw(st.sampled_from([k for k in (1, 2, 4) if k < tokens and tokens % k == 0]))
    pad = 0
    if kind in ("attention", "mla", "mamba") and order in PADDABLE_ORDERS and not kernel and draw(st.booleans()):
        pad = draw(st.sampled_from([1, 5, 64]))
    slack = 0
    if order[0] == "B" and not kernel and draw(st.booleans()):
        slack = draw(st.sampled_from([1, 8, 4096]))  # another group's larger block (vLLM's block-outermost groups)
    return SideCase(tokens=tokens, blocks_n=draw(st.integers(4, 12)), stride_order=order, pad=pad, kernel=kernel,
                    slack=slack)  # fmt: skip


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["attention", "quantized", "kv_planes", "mla", "mamba"]))
    head_size_v = 0
    if kind == "attention":
        dtype = draw(st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"]))
        head_size = draw(st.sampled_from([1, 2, 4]))
        head_size_v = draw(st.sampled_from([0, 0, 1, 3, 8]))
    elif kind == "quantized":
        dtype = draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "int8", "nvfp4"]))
        head_size = draw(st.sampled_from([16, 32] if dtype == "nvfp4" else [2, 4, 8]))
    elif kind == "kv_planes":
        dtype = draw(st.sampled_from(["bf16", "fp32", "fp8_e4m3", "int8"]))
        head_size = draw(st.sampled_from([1, 2, 4]))
    elif kind == "mla":
        dtype = draw(st.sampled_from(["bf16", "fp16", "fp8_e4m3", "int8"]))
        head_size = draw(st.sampled_from([3, 8]))
    else:
        dtype, head_size = "int8", draw(st.sampled_from([1, 7, 64]))
    total_heads = draw(st.sampled_from([1, 2, 4, 8])) if kind in ("attention", "quantized", "kv_planes") else 1
    local_tp = draw(st.sampled_from([1, 2, 4, 8]))
    remote_tp = local_tp if kind == "mamba" else draw(st.sampled_from([1, 2, 4, 8]))
    local_rank = draw(st.integers(0, local_tp - 1))
    if kind == "mamba":
        local_tokens = remote_tokens = 1
    else:
        local_tokens = draw(st.sampled_from([1, 2, 4, 8]))
        ratio = draw(st.sampled_from([1, 2, 4]))
        remote_tokens = local_tokens * ratio if draw(st.booleans()) else max(1, local_tokens // ratio)
    local = _side_case(draw, kind, dtype, local_tokens)
    remote = _side_case(draw, kind, dtype, remote_tokens)
    big = max(local_tokens, remote_tokens)
    max_c = min(local.blocks_n * local_tokens, remote.blocks_n * remote_tokens) // big
    tokens = draw(st.integers(1, max(1, max_c))) * big
    return Case(
        kind=kind,
        dtype=dtype,
        layers=draw(st.integers(1, 3)),
        total_heads=total_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        local_tp=local_tp,
        local_rank=local_rank,
        remote_tp=remote_tp,
        local=local,
        remote=remote,
        local_blocks=_block_list(draw, local.blocks_n, tokens // local_tokens),
        remote_blocks=_block_list(draw, remote.blocks_n, tokens // remote_tokens),
    )


def _side(case: Case, sc: SideCase, tp: int, rank: int) -> Side:
    h0, h1 = heads_of_rank(case.total_heads, tp, rank)
    segments = tuple(g // tp for g in case.segments)
    side = Side(
        kind=case.kind,
        dtype=case.dtype,
        layers=case.layers,
        blocks=sc.blocks_n,
        block_size=sc.tokens,
        heads=h1 - h0,
        head_start=h0,
        total_heads=case.total_heads,
        head_size=sum(segments) if segments else case.head_size,
        head_size_v=case.head_size_v or case.head_size,
        stride_order=sc.stride_order,
        kernel_block_size=sc.kernel,
        rank=rank,
        segments=segments,
        tp_size=tp,
        replicated=case.replicated,
    )
    if sc.pad:
        side = dataclasses.replace(side, page_stride=side.page_bytes + sc.pad)
    if sc.slack:
        own = side.layers * (side.page_stride or side.page_bytes)
        side = dataclasses.replace(side, block_bytes=own + sc.slack)
    return side


def _layout(case: Case, side: Side) -> KVCacheLayout:
    """The kvxfer layout of ``side``, built with the public constructor of its kind."""
    order, cross, heads_outer = ORDER_FIELDS[side.stride_order]
    layers, blocks, tokens, kernel = case.layers, side.blocks, side.block_size, side.kernel_block_size
    if case.kind == "mamba":
        return KVCacheLayout.mamba(num_layers=layers, num_blocks=blocks, page_size_bytes=side.head_size,
                                   cross_layer=cross, page_stride=side.page_stride, block_bytes=side.block_bytes,
                                   segments=side.segments, replicated=side.replicated)  # fmt: skip
    if case.kind == "mla":
        return KVCacheLayout.mla(num_layers=layers, num_blocks=blocks, block_size=tokens, latent_dim=case.head_size,
                                 dtype=case.dtype, cross_layer=cross, page_stride=side.page_stride,
                                 kernel_block_size=kernel, block_bytes=side.block_bytes)  # fmt: skip
    if case.kind == "kv_planes":
        return KVCacheLayout.kv_planes(num_layers=layers, num_blocks=blocks, block_size=tokens, num_kv_heads=side.heads,
                                       head_size=case.head_size, dtype=case.dtype, order=order,
                                       total_kv_heads=case.total_heads, cross_layer=cross,
                                       kernel_block_size=kernel, block_bytes=side.block_bytes)  # fmt: skip
    if case.kind == "quantized":
        return KVCacheLayout.quantized(num_layers=layers, num_blocks=blocks, block_size=tokens, num_kv_heads=side.heads,
                                       head_size=case.head_size, dtype=case.dtype, order=order,
                                       total_kv_heads=case.total_heads, cross_layer=cross, heads_outer=heads_outer,
                                       kernel_block_size=kernel, block_bytes=side.block_bytes)  # fmt: skip
    return KVCacheLayout.attention(num_layers=layers, num_blocks=blocks, block_size=tokens, num_kv_heads=side.heads,
                                   head_size=case.head_size, dtype=case.dtype, order=order,
                                   total_kv_heads=case.total_heads, cross_layer=cross, heads_outer=heads_outer,
                                   head_size_v=case.head_size_v, page_stride=side.page_stride,
                                   kernel_block_size=kernel, block_bytes=side.block_bytes)  # fmt: skip


def _check_layout(layout: KVCacheLayout, side: Side) -> None:
    assert layout.stride_order == side.stride_order
    assert layout.page_bytes == side.page_bytes
    assert (layout.num_regions, layout.region_bytes) == (side.regions, side.region_bytes)


def _ascending(ids: tuple[int, ...]) -> bool:
    return all(a < b for a, b in itertools.pairwise(ids))


def filled_remotes(case: Case, rng: np.random.Generator) -> tuple[list[Side], np.ndarray, list[np.ndarray]]:
    """Every remote rank's side and buffer, holding the case's logical values (and the values)."""
    remote_sides = [_side(case, case.remote, case.remote_tp, q) for q in range(case.remote_tp)]
    check_side(remote_sides[0])
    values = logical_values(rng, remote_sides[0], case.remote_tp)
    remote_bufs = []
    for side in remote_sides:
        buf = rng.integers(0, 256, size=side.buffer_bytes(), dtype=np.uint8)
        fill_remote(side, values, buf)
        remote_bufs.append(buf)
    return remote_sides, values, remote_bufs


def run_case(case: Case) -> TransferPlan:
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    local_side = _side(case, case.local, case.local_tp, case.local_rank)
    check_side(local_side)
    remote_sides, values, remote_bufs = filled_remotes(case, rng)
    local_buf = rng.integers(0, 256, size=local_side.buffer_bytes(), dtype=np.uint8)
    lb, rb = np.array(case.local_blocks), np.array(case.remote_blocks)
    expected = expected_after_pull(local_side, local_buf, values, lb, rb, case.remote.tokens)

    local_layout = _layout(case, local_side)
    remote_layout = _layout(case, remote_sides[0])
    _check_layout(local_layout, local_side)
    _check_layout(remote_layout, remote_sides[0])
    topo = TransferTopology(local_layout, remote_layout, RankInfo(case.local_rank, case.local_tp), case.remote_tp)
    plan = topo.plan(lb, rb)
    local_table = RegionTable.for_layout(local_layout, local_side.bases())
    written = np.zeros(local_buf.size, dtype=np.int32)
    for rp in plan.per_rank:
        table = RegionTable.for_layout(remote_layout, remote_sides[rp.remote_rank].bases())
        ldesc, rdesc = rp.descriptors(local_table, table)
        assert ldesc.dtype == np.uint64
        assert ldesc.shape == (rp.num_descriptors, 3)
        assert (ldesc[:, 1] > 0).all()
        for a, n, _ in ldesc.tolist():
            written[a : a + n] += 1
        apply_descriptors(local_buf, remote_bufs[rp.remote_rank], ldesc, rdesc)
    assert written.max() <= 1, "two descriptors write the same local byte"
    assert plan.total_bytes == len(lb) * case.layers * local_side.page_bytes
    np.testing.assert_array_equal(local_buf, expected)
    moved = byte_map(local_side, remote_sides, lb, rb)
    assert moved.local.size == plan.total_bytes
    # Coalescing never issues more descriptors than copying row by row would, nor fewer than possible.
    fewest = moved.fewest_descriptors()
    assert fewest <= plan.num_descriptors <= plan.per_block_descriptors <= moved.naive_descriptors()
    if _ascending(case.local_blocks) and _ascending(case.remote_blocks):
        # runs of blocks on both sides in request order: nothing contiguous on both sides is left apart
        assert plan.num_descriptors == fewest
    return plan


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_descriptors_match_naive_model(case: Case) -> None:
    run_case(case)


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "local_order", "remote_order"),
    [(1, 1, "LBHNC", "BLHNC"), (2, 1, "LBHNC", "BLHNC"), (1, 2, "LBHNC", "BLHNC"), (4, 2, "LBNHC", "BLNHC"),
     (2, 4, "LBNHC", "BLNHC"), (8, 1, "LBHNC", "BLHNC"), (1, 8, "LBNHC", "BLNHC"),
     (8, 1, "LHBNC", "BHLNC"), (2, 4, "BHLNC", "LBNHC"), (4, 2, "BLNHC", "LHBNC")],
)  # fmt: skip
def test_every_decode_rank_of_a_tp_pair(local_tp: int, remote_tp: int, local_order: str, remote_order: str) -> None:
    for rank in range(local_tp):
        run_case(
            Case(
                kind="attention",
                dtype="bf16",
                layers=2,
                total_heads=4,
                head_size=2,
                head_size_v=0,
                local_tp=local_tp,
                local_rank=rank,
                remote_tp=remote_tp,
                local=SideCase(tokens=4, blocks_n=8, stride_order=local_order),
                remote=SideCase(tokens=8, blocks_n=6, stride_order=remote_order),
                local_blocks=(7, 0, 1, 2),
                remote_blocks=(5, 0),
            )
        )


@pytest.mark.parametrize("kind", ["attention", "quantized", "kv_planes", "mla", "mamba"])
@pytest.mark.parametrize("local_order", ["LBHNC", "BLHNC", "LBNHC", "BHLNC"])
def test_every_kind_and_order_against_the_model(kind: str, local_order: str) -> None:
    """A fixed sweep over kinds and orders (hypothesis explores further), with padding and kernel blocks."""
    dtype = {"attention": "bf16", "quantized": "nvfp4", "kv_planes": "fp16", "mla": "fp8_e4m3", "mamba": "int8"}[kind]
    orders = _orders(kind, dtype)
    local_order = local_order if local_order in orders else orders[-1]
    remote_order = orders[0]
    mamba = kind == "mamba"
    heads = 1 if kind in ("mla", "mamba") else 4
    local_tp, remote_tp = (2, 2) if mamba else (2, 1) if kind != "mla" else (2, 4)
    pad = 24 if kind in ("attention", "mla", "mamba") and local_order in PADDABLE_ORDERS else 0
    local = SideCase(tokens=1 if mamba else 8, blocks_n=6, stride_order=local_order, pad=pad)
    remote = SideCase(tokens=1 if mamba else 4, blocks_n=9, stride_order=remote_order, kernel=0 if mamba else 2)
    for rank in range(local_tp):
        run_case(
            Case(
                kind=kind,
                dtype=dtype,
                layers=2,
                total_heads=heads,
                head_size={"quantized": 32, "mla": 6, "mamba": 40}.get(kind, 2),
                head_size_v=3 if kind == "attention" else 0,
                local_tp=local_tp,
                local_rank=rank,
                remote_tp=remote_tp,
                local=local,
                remote=remote,
                local_blocks=(3, 4) if not mamba else (3, 4, 5, 0),
                remote_blocks=(5, 6, 7, 1) if not mamba else (1, 2, 3, 8),
            )
        )
