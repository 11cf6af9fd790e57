"""Mamba state across TP sizes: a page split in TP segments, or replicated, against the byte-level model.

Every case builds each prefill rank's pages from one global state (``reference.Side`` with
``segments``), applies the planned descriptors of one decode rank and checks every byte of its
memory (``run_case``); refusals are checked word for word.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import IncompatibleLayoutError, LayoutError, TopologyError
from kvxfer.layout import KVCacheLayout
from kvxfer.topology import PushTopology, RankInfo, TransferTopology

from .test_topology_reference import Case, SideCase, _block_list, _side_case, run_case

TP_SIZES = [1, 2, 3, 4, 8]


@st.composite
def mamba_cases(draw: st.DrawFn) -> Case:
    local_tp, remote_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    replicated = draw(st.booleans()) and draw(st.booleans())
    segments: tuple[int, ...] = ()
    if not replicated:
        unit = math.lcm(local_tp, remote_tp)
        segments = tuple(unit * k for k in draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    local, remote = _side_case(draw, "mamba", "int8", 1), _side_case(draw, "mamba", "int8", 1)
    n = draw(st.integers(1, min(local.blocks_n, remote.blocks_n)))
    return Case(
        kind="mamba", dtype="int8", layers=draw(st.integers(1, 3)), total_heads=1,
        head_size=draw(st.sampled_from([1, 7, 64])), head_size_v=0, local_tp=local_tp,
        local_rank=draw(st.integers(0, local_tp - 1)), remote_tp=remote_tp, local=local, remote=remote,
        local_blocks=_block_list(draw, local.blocks_n, n), remote_blocks=_block_list(draw, remote.blocks_n, n),
        segments=segments, replicated=replicated,
    )  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mamba_cases())
def test_mamba_state_across_tp_sizes_matches_the_model(case: Case) -> None:
    """Any two TP sizes (D > P, P > D, equal, neither a multiple of the other), padded pages,
    block-major regions, several layers: every decode byte is the global state's byte."""
    run_case(case)


def _case(local_tp: int, remote_tp: int, rank: int, segments: tuple[int, ...], *, replicated: bool = False,
          local: SideCase | None = None, remote: SideCase | None = None) -> Case:  # fmt: skip
    return Case(
        kind="mamba", dtype="int8", layers=2, total_heads=1, head_size=48, head_size_v=0, local_tp=local_tp,
        local_rank=rank, remote_tp=remote_tp,
        local=local or SideCase(tokens=1, blocks_n=8, stride_order="LBHNC", pad=16),
        remote=remote or SideCase(tokens=1, blocks_n=6, stride_order="BLHNC"),
        local_blocks=(3, 4, 5, 0), remote_blocks=(1, 2, 3, 5), segments=segments, replicated=replicated,
    )  # fmt: skip


# Mamba2 in DS layout: x, B, C of the conv state, then the SSM state (sizes in bytes, global).
MAMBA2 = (3 * 2 * 64, 3 * 2 * 16, 3 * 2 * 16, 8 * 16 * 4)


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 2), (2, 1), (4, 2), (2, 4), (8, 1), (1, 8), (2, 2), (4, 4)])
@pytest.mark.parametrize("cross", [False, True])
def test_every_decode_rank_of_a_tp_pair(local_tp: int, remote_tp: int, cross: bool) -> None:
    order = "BLHNC" if cross else "LBHNC"
    for rank in range(local_tp):
        plan = run_case(_case(local_tp, remote_tp, rank, MAMBA2,
                              local=SideCase(tokens=1, blocks_n=8, stride_order=order),
                              remote=SideCase(tokens=1, blocks_n=6, stride_order=order)))  # fmt: skip
        # Decode rank d reads prefill ranks [d * P // D, ...): one when D >= P, P / D of them otherwise.
        first = rank * remote_tp // local_tp
        stop = max(first + 1, (rank + 1) * remote_tp // local_tp)
        assert [p.remote_rank for p in plan.per_rank] == list(range(first, stop))


def test_replicated_state_reads_one_rank_whole_pages() -> None:
    for rank in range(4):
        plan = run_case(_case(4, 2, rank, (), replicated=True))
        assert [p.remote_rank for p in plan.per_rank] == [rank % 2]
        assert "replicated" in plan.per_rank[0].source.reason
        # whole pages, one per block and layer (the local pages are padded, so blocks do not merge)
        assert plan.per_rank[0].length.tolist() == [48] * 8  # 4 blocks x 2 layers


def test_pieces_of_one_page_for_decode_tp_2_from_prefill_tp_1() -> None:
    """Decode rank 1 of 2 takes the second half of each segment of the prefill page, at its own offsets."""
    local = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 20))
    remote = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=60, segments=(20, 40))
    plan = TransferTopology(local, remote, RankInfo(1, 2), 1).plan([2], [3])
    (rp,) = plan.per_rank
    assert rp.remote_rank == 0
    assert rp.local_offset.tolist() == [2 * 30, 2 * 30 + 10]
    assert rp.remote_offset.tolist() == [3 * 60 + 10, 3 * 60 + 20 + 20]
    assert rp.length.tolist() == [10, 20]


def test_equal_tp_whole_contiguous_pages_merge_across_blocks() -> None:
    """Same TP on both sides: each page's segments are one span, and runs of blocks one descriptor."""
    lay = KVCacheLayout.mamba(num_layers=2, num_blocks=8, page_size_bytes=30, segments=(10, 20))
    plan = TransferTopology(lay, lay, RankInfo(1, 2), 2).plan([2, 3, 4], [5, 6, 7])
    (rp,) = plan.per_rank
    assert rp.remote_rank == 1
    assert rp.length.tolist() == [90, 90]  # one per layer


def test_prefill_tp_larger_gathers_from_every_rank_it_needs() -> None:
    local = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=12, segments=(4, 8))
    remote = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=3, segments=(1, 2))
    topo = TransferTopology(local, remote, RankInfo(0, 1), 4)
    assert [s.remote_rank for s in topo.sources()] == [0, 1, 2, 3]
    plan = topo.plan([1], [2])
    for q, rp in enumerate(plan.per_rank):
        assert rp.local_offset.tolist() == [12 + q, 12 + 4 + 2 * q]
        assert rp.remote_offset.tolist() == [6, 6 + 1]
        assert rp.length.tolist() == [1, 2]


def test_push_writes_each_decode_byte_once() -> None:
    """Two prefill ranks push into one decode rank: each writes its slice of each segment, nothing twice."""
    recv = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=6, segments=(2, 4))
    send = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=3, segments=(1, 2))
    written: dict[tuple[int, int], int] = {}
    for p in range(2):
        push = PushTopology(send, (recv,), RankInfo(p, 2))
        assert push.targets == (0,)
        plan = push.plan([1], [3])
        for d, rp in plan.per_target:
            for off, n in zip(rp.local_offset.tolist(), rp.length.tolist(), strict=True):
                for b in range(off, off + n):
                    assert (d, b) not in written
                    written[(d, b)] = p
    assert written == {(0, 18 + i): [0, 1, 0, 0, 1, 1][i] for i in range(6)}


# ----------------------------------------------------------------------------- refusals
def test_layout_refuses_segments_that_do_not_fill_the_page() -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.mamba(num_layers=1, num_blocks=2, page_size_bytes=64, segments=(16, 32))
    assert err.value.field == "segments"
    assert str(err.value) == "segments: [16, 32] sum to 48 bytes, the mamba page holds page_size_bytes=64"


def test_layout_refuses_segments_with_replicated_and_on_other_kinds() -> None:
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.mamba(num_layers=1, num_blocks=2, page_size_bytes=64, segments=(64,), replicated=True)
    assert str(err.value) == (
        "segments: a replicated mamba page (replicated=True) is not split over TP ranks, got segments [64]"
    )
    mla = KVCacheLayout.mla(num_layers=1, num_blocks=2, block_size=16, latent_dim=8)
    with pytest.raises(LayoutError) as err:
        KVCacheLayout(**{**mla.to_dict(), "segments": [16]})
    assert str(err.value) == "segments: only a mamba page is split into TP segments, not a mla cache"
    with pytest.raises(LayoutError) as err:
        KVCacheLayout(**{**mla.to_dict(), "replicated": True})
    assert str(err.value) == "replicated: only a mamba page carries this flag, not a mla cache"
    with pytest.raises(LayoutError) as err:
        KVCacheLayout.mamba(num_layers=1, num_blocks=2, page_size_bytes=64, segments=(64, 0))
    assert str(err.value) == "segments: every size must be a positive integer, got [64, 0]"


def test_topology_refuses_segments_of_other_global_sizes() -> None:
    local = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 20))
    remote = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 20))
    with pytest.raises(TopologyError) as err:
        TransferTopology(local, remote, RankInfo(0, 2), 1)
    assert err.value.field == "segments"
    assert str(err.value) == (
        "segments: segment 0 of the mamba state is 10 bytes per rank x local tp_size 2 = 20 bytes, but 10 bytes per "
        "rank x remote tp_size 1 = 10 bytes (local segments [10, 20], remote [10, 20])"
    )


def test_layouts_split_differently_are_incompatible() -> None:
    three = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 10, 10))
    two = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 20))
    assert three.incompatibilities(two) == [
        "segments: local 3 segments [10, 10, 10], remote 2 segments [10, 20] (the mamba states are split differently)"
    ]
    rep = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, replicated=True)
    assert two.incompatibilities(rep) == [
        "replicated: local False, remote True (one side holds the whole mamba state on every rank, the other splits "
        "it in segments)"
    ]
    with pytest.raises(IncompatibleLayoutError):
        TransferTopology(three, two, RankInfo(0, 1), 1)


def test_opaque_pages_keep_todays_rule() -> None:
    """Without segments on both sides a page is opaque: equal TP only, today's message."""
    split = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, segments=(10, 20))
    opaque = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30)
    plan = TransferTopology(split, opaque, RankInfo(1, 2), 2).plan([0], [1])
    assert plan.per_rank[0].remote_rank == 1
    assert plan.per_rank[0].length.tolist() == [30]
    assert split.incompatibilities(dataclass_page(opaque, 60)) == [
        "page_size_bytes: local 30, remote 60 (the remote page has no TP segments: it moves whole, between equal TP "
        "sizes only)"
    ]
    for a, b in ((split, opaque), (opaque, opaque)):
        with pytest.raises(TopologyError) as err:
            TransferTopology(a, b, RankInfo(0, 2), 1)
        assert str(err.value) == (
            "tp_size: a mamba page is opaque, so heterogeneous TP (local 2, remote 1) cannot be split per head; "
            "use the same TP size on both sides"
        )


def dataclass_page(layout: KVCacheLayout, page: int) -> KVCacheLayout:
    return KVCacheLayout.mamba(num_layers=layout.num_layers, num_blocks=layout.num_blocks, page_size_bytes=page)


def test_resharded_scales_segments_and_refuses_an_uneven_split() -> None:
    lay = KVCacheLayout.mamba(num_layers=1, num_blocks=4, page_size_bytes=30, page_stride=64, segments=(10, 20))
    assert lay.resharded(2, 4).segments == (5, 10)
    assert lay.resharded(2, 4).page_bytes == 15
    assert lay.resharded(2, 2) is lay
    with pytest.raises(LayoutError) as err:
        lay.resharded(2, 3)
    assert str(err.value) == (
        "segments: segment 0 of the mamba state is 20 bytes (10 per rank x tp_size 2), which does not split evenly "
        "over tp_size 3"
    )


def test_round_trips_through_to_dict() -> None:
    lay = KVCacheLayout.mamba(num_layers=2, num_blocks=4, page_size_bytes=30, segments=[10, 20])
    assert lay.segments == (10, 20)
    assert KVCacheLayout.from_dict(lay.to_dict()) == lay
    rep = KVCacheLayout.mamba(num_layers=2, num_blocks=4, page_size_bytes=30, replicated=True)
    assert KVCacheLayout.from_dict(rep.to_dict()) == rep
    assert rep != KVCacheLayout.mamba(num_layers=2, num_blocks=4, page_size_bytes=30)
