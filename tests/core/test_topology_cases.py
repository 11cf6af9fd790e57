"""Exact descriptor counts, sources and errors for known transfers."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from kvxfer.errors import BlockIdError, IncompatibleLayoutError, LayoutError, TopologyError
from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo, RankPlan, RegionTable, TransferTopology, parse_block_ids


def llama(tp: int = 1, *, layers: int = 64, blocks: int = 4096, order: str = "HND", cross: bool = False,
          block_size: int = 16) -> KVCacheLayout:  # fmt: skip
    return KVCacheLayout.attention(
        num_layers=layers, num_blocks=blocks, block_size=block_size, num_kv_heads=8 // tp, head_size=128,
        total_kv_heads=8, order=order, cross_layer=cross,
    )  # fmt: skip


def test_contiguous_same_tp_is_one_descriptor_per_layer() -> None:
    plan = TransferTopology(llama(), llama(), RankInfo(0, 1), 1).plan(np.arange(2048), np.arange(2048))
    assert plan.num_descriptors == 64
    assert plan.per_block_descriptors == 64 * 2048
    assert plan.total_bytes == 64 * 2048 * 65536
    assert plan.per_rank[0].length.tolist() == [2048 * 65536] * 64


def test_cross_layer_contiguous_is_one_descriptor() -> None:
    plan = TransferTopology(llama(cross=True), llama(cross=True), RankInfo(0, 1), 1).plan(
        np.arange(100, 2148), np.arange(2048)
    )
    assert plan.num_descriptors == 1
    rp = plan.per_rank[0]
    assert (rp.local_offset.tolist(), rp.remote_offset.tolist()) == ([100 * 64 * 65536], [0])
    assert rp.length.tolist() == [2048 * 64 * 65536]


def test_cross_layer_local_per_layer_remote_cannot_merge_layers() -> None:
    plan = TransferTopology(llama(cross=False), llama(cross=True), RankInfo(0, 1), 1).plan(np.arange(8), np.arange(8))
    # local pages of one layer are contiguous, remote ones are not (block stride = 64 pages)
    assert plan.num_descriptors == 64 * 8


def test_runs_coalesce_independently_on_both_sides() -> None:
    local = np.array([0, 1, 2, 10, 11, 20])
    remote = np.array([5, 6, 7, 8, 9, 30])  # breaks after 7 (local jumps) and after 9 (both)
    plan = TransferTopology(llama(layers=2), llama(layers=2), RankInfo(0, 1), 1).plan(local, remote)
    rp = plan.per_rank[0]
    assert plan.num_descriptors == 2 * 3
    page = 65536
    assert rp.local_offset[:3].tolist() == [0, 10 * page, 20 * page]
    assert rp.remote_offset[:3].tolist() == [5 * page, 8 * page, 30 * page]
    assert rp.length[:3].tolist() == [3 * page, 2 * page, page]
    assert rp.local_region.tolist() == [0, 0, 0, 1, 1, 1]


def test_decode_tp2_from_prefill_tp1_hnd_one_span_per_block() -> None:
    topo = TransferTopology(llama(2), llama(1), RankInfo(1, 2), 1)
    (src,) = topo.sources()
    assert (src.remote_rank, src.local_head, src.remote_head, src.num_heads) == (0, 0, 4, 4)
    plan = topo.plan(np.arange(16), np.arange(16))
    rp = plan.per_rank[0]
    assert plan.num_descriptors == 64 * 16
    # local pages are whole (4 heads), contiguous across blocks, but remote slices are not.
    assert rp.length[:2].tolist() == [32768, 32768]
    assert rp.remote_offset[:2].tolist() == [4 * 16 * 512, 65536 + 4 * 16 * 512]


def test_decode_tp1_from_prefill_tp2_reads_two_ranks_each_at_its_offset() -> None:
    topo = TransferTopology(llama(1, layers=1), llama(2, layers=1), RankInfo(0, 1), 2)
    plan = topo.plan(np.arange(4), np.arange(4))
    assert [rp.remote_rank for rp in plan.per_rank] == [0, 1]
    half = 4 * 16 * 512
    assert plan.per_rank[0].local_offset.tolist() == [i * 65536 for i in range(4)]
    assert plan.per_rank[1].local_offset.tolist() == [i * 65536 + half for i in range(4)]
    # on the remote side a whole page of a 4-head rank: contiguous over blocks, but local is not
    assert plan.per_rank[1].remote_offset.tolist() == [i * half for i in range(4)]


def test_nhd_head_slice_needs_one_span_per_token_and_warns() -> None:
    plan = TransferTopology(llama(2, order="NHD"), llama(1, order="NHD"), RankInfo(0, 2), 1).plan(
        np.arange(10), np.arange(10)
    )
    assert plan.num_descriptors == 64 * 10 * 16
    assert any("one per token" in w for w in plan.warnings)


def test_replicated_heads_spread_over_replicas() -> None:
    def lay(tp: int) -> KVCacheLayout:
        return KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=max(1, 2 // tp),
                                       head_size=64, total_kv_heads=2)  # fmt: skip

    # remote TP 4 over 2 heads: ranks (0,1) hold head 0, (2,3) hold head 1
    picks = [[s.remote_rank for s in TransferTopology(lay(1), lay(4), RankInfo(0, 1), 4).sources()]]
    picks += [[s.remote_rank for s in TransferTopology(lay(2), lay(4), RankInfo(r, 2), 4).sources()] for r in (0, 1)]
    assert picks == [[0, 2], [0], [3]]


def test_mla_reads_one_remote_rank_and_says_which() -> None:
    mla = KVCacheLayout.mla(num_layers=4, num_blocks=32, block_size=16, latent_dim=576)
    for rank, expected in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        (src,) = TransferTopology(mla, mla, RankInfo(rank, 4), 2).sources()
        assert src.remote_rank == expected
        assert f"remote rank {expected}" in src.reason
    plan = TransferTopology(mla, mla, RankInfo(3, 4), 2).plan(np.arange(32), np.arange(32))
    assert plan.num_descriptors == 4


def test_mamba_whole_pages_and_refuses_heterogeneous_tp() -> None:
    mamba = KVCacheLayout.mamba(num_layers=2, num_blocks=10, page_size_bytes=4096)
    plan = TransferTopology(mamba, mamba, RankInfo(1, 2), 2).plan([3, 4, 9], [0, 1, 2])
    assert plan.per_rank[0].remote_rank == 1
    assert plan.num_descriptors == 2 * 2
    with pytest.raises(TopologyError, match="mamba page is opaque"):
        TransferTopology(mamba, mamba, RankInfo(0, 1), 2)


def test_heterogeneous_block_size_split_and_merge() -> None:
    small, big = llama(layers=1, block_size=16), llama(layers=1, blocks=2048, block_size=32)
    plan = TransferTopology(small, big, RankInfo(0, 1), 1).plan([0, 1, 5, 6], [3, 7])
    # HND: each remote block half is 8 per-head spans; local page 0 and 1 are adjacent but the
    # remote halves interleave per head, so nothing merges across heads.
    assert plan.num_chunks == 4
    assert plan.num_descriptors == 4 * 8
    assert plan.total_bytes == 4 * 65536
    nhd_small, nhd_big = llama(layers=1, order="NHD"), llama(layers=1, blocks=2048, block_size=32, order="NHD")
    plan = TransferTopology(nhd_small, nhd_big, RankInfo(0, 1), 1).plan([0, 1, 5, 6], [3, 7])
    # NHD: token-major, so local pages 0,1 fill remote block 3 as one span.
    assert plan.num_descriptors == 2


@pytest.mark.parametrize(
    ("local", "remote", "message"),
    [
        ([], [], "local_blocks: empty block list"),
        ([0, 4096], [0, 1], "local_blocks: block id 4096 at position 1 is out of range [0, 4096)"),
        ([0, 1], [-1, 1], "remote_blocks: block id -1 at position 0 is out of range"),
        ([3, 3], [0, 1], "local_blocks: block id 3 appears more than once"),
        ([0, 1], [5, 5], "remote_blocks: block id 5 appears more than once"),
        (
            [0, 1, 2],
            [0, 1],
            "remote_blocks: length mismatch: 3 local blocks x 16 tokens = 48 tokens, 2 remote blocks x 16",
        ),
        ([[0, 1]], [0, 1], "local_blocks: expected a flat list"),
        ([0.5], [0], "local_blocks: block ids must be integers, got dtype float64"),
    ],
)
def test_bad_block_lists_are_refused(local: list[int], remote: list[int], message: str) -> None:
    topo = TransferTopology(llama(layers=1), llama(layers=1), RankInfo(0, 1), 1)
    with pytest.raises(BlockIdError, match="^" + re.escape(message)):
        topo.plan(np.array(local), np.array(remote))


def test_incompatible_layouts_list_every_difference() -> None:
    a = llama(layers=32)
    b = KVCacheLayout.attention(num_layers=30, num_blocks=10, block_size=24, num_kv_heads=8, head_size=64,
                                dtype="fp16")  # fmt: skip
    with pytest.raises(IncompatibleLayoutError) as err:
        TransferTopology(a, b, RankInfo(0, 1), 1)
    assert err.value.differences == (
        "dtype: local bf16, remote fp16",
        "num_layers: local 32, remote 30",
        "head_size: local 128, remote 64",
        "block_size: local 16, remote 24 (neither is a multiple of the other)",
    )
    assert err.value.status == "FAILED_PRECONDITION"


def test_head_count_must_match_tp_split() -> None:
    with pytest.raises(TopologyError, match="num_kv_heads: remote rank holds 8 heads but 8 heads over tp_size 2"):
        TransferTopology(llama(1), llama(1), RankInfo(0, 1), 2)
    with pytest.raises(TopologyError, match="pp_size"):
        TransferTopology(llama(), llama(), RankInfo(0, 1, 0, 2), 1)


def test_descriptors_resolve_addresses_and_refuse_small_regions() -> None:
    lay = llama(layers=2, blocks=4)
    plan = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan([1, 2], [0, 3])
    local = RegionTable.for_layout(lay, [1 << 20, 1 << 30], device=0)
    remote = RegionTable.for_layout(lay, [4096, 1 << 24], device=3)
    ld, rd = plan.per_rank[0].descriptors(local, remote)
    page = 65536
    # local [1, 2] is one run but remote [0, 3] is not, so nothing merges
    assert ld.tolist() == [
        [(1 << 20) + page, page, 0], [(1 << 20) + 2 * page, page, 0],
        [(1 << 30) + page, page, 0], [(1 << 30) + 2 * page, page, 0],
    ]  # fmt: skip
    assert rd.tolist() == [
        [4096, page, 3], [4096 + 3 * page, page, 3], [(1 << 24), page, 3], [(1 << 24) + 3 * page, page, 3]
    ]  # fmt: skip
    tiny = RegionTable(np.array([0, 0], np.uint64), np.array([page, page], np.uint64), np.zeros(2, np.uint64))
    with pytest.raises(LayoutError, match="overruns region 0"):
        plan.per_rank[0].descriptors(tiny, remote)
    one = RegionTable(np.array([0], np.uint64), np.array([1 << 40], np.uint64), np.zeros(1, np.uint64))
    with pytest.raises(LayoutError, match=r"^regions: remote descriptors need region 1, only 1 registered$"):
        plan.per_rank[0].descriptors(local, one)


def test_parse_block_ids() -> None:
    assert parse_block_ids("0:4,9, 11").tolist() == [0, 1, 2, 3, 9, 11]
    with pytest.raises(BlockIdError, match="cannot parse 'x'"):
        parse_block_ids("1,x")


def test_heterogeneous_block_size_local_larger_than_remote() -> None:
    big, small = llama(layers=2, blocks=64, block_size=32), llama(layers=2, blocks=64, block_size=16)
    # local blocks 4 and 5 (32 tokens each) take remote 16-token blocks 10, 11 | 12, 13
    plan = TransferTopology(big, small, RankInfo(0, 1), 1).plan([4, 5], [10, 11, 12, 13])
    (rp,) = plan.per_rank
    assert plan.num_chunks == 4
    # HND: remote blocks 10 and 11 fill local block 4 head by head (head h: 16 rows from 10, then 16 from
    # 11), 2 x 8 spans per local block. Only the last head of block 4 (from 11) and the first head of
    # block 5 (from 12) are adjacent on both sides: 2 x 16 - 1 per layer.
    assert plan.num_descriptors == 2 * (2 * 16 - 1)
    # Head h of local block L (32 rows at L * 131072 + h * 16384) takes 16 rows of head h from each of
    # its two remote blocks (at R * 65536 + h * 8192). Which order the descriptors come in is incidental.
    units = [
        (lb * 131072 + h * 16384 + k * 8192, rb * 65536 + h * 8192, 8192)
        for lb, pair in ((4, (10, 11)), (5, (12, 13)))
        for h in range(8)
        for k, rb in enumerate(pair)
    ]
    merged = (4 * 131072 + 7 * 16384 + 8192, 11 * 65536 + 7 * 8192, 2 * 8192)  # last of block 4 + first of 5
    want = sorted([u for u in units if u[0] not in (merged[0], 5 * 131072)] + [merged])
    got = list(zip(rp.local_offset.tolist(), rp.remote_offset.tolist(), rp.length.tolist(), strict=True))
    assert sorted(got[:31]) == want
    assert sorted(got[31:]) == want
    assert rp.local_region.tolist() == [0] * 31 + [1] * 31
    with pytest.raises(BlockIdError, match=r"^remote_blocks: length mismatch: 2 local blocks x 32 tokens = 64 tokens, "
                                           r"3 remote blocks x 16 tokens = 48 tokens"):  # fmt: skip
        TransferTopology(big, small, RankInfo(0, 1), 1).plan([4, 5], [10, 11, 12])


def test_nhd_head_slice_counts_one_span_per_token_exactly() -> None:
    topo = TransferTopology(llama(2, order="NHD", layers=3), llama(1, order="NHD", layers=3), RankInfo(1, 2), 1)
    plan = topo.plan([0, 1, 2], [7, 8, 9])
    (rp,) = plan.per_rank
    assert (plan.num_descriptors, plan.per_block_descriptors, rp.raw_spans) == (3 * 3 * 16, 3 * 3 * 16, 3 * 16)
    # token t of local block 0 is 4 heads x 512 B at t * 2048; remote rank 0 holds 8 heads: heads 4..8 of token t
    assert rp.local_offset[:2].tolist() == [0, 2048]
    assert rp.remote_offset[:2].tolist() == [7 * 65536 + 4 * 512, 7 * 65536 + 4096 + 4 * 512]
    assert set(rp.length.tolist()) == {2048}
    assert plan.warnings == (
        "NHD with a head slice: 16 spans per chunk per layer (one per token); HND keeps a head slice contiguous",
    )


def test_sources_say_which_rank_and_why() -> None:
    (src,) = TransferTopology(llama(2), llama(1), RankInfo(1, 2), 1).sources()
    assert src.reason == "remote rank 0 holds heads [0, 8); local rank 1 needs [4, 8)"
    mla = KVCacheLayout.mla(num_layers=4, num_blocks=32, block_size=16, latent_dim=576)
    (src,) = TransferTopology(mla, mla, RankInfo(3, 4), 2).sources()
    assert src.reason == "MLA latent is replicated on every rank: read it from remote rank 1"

    def lay(tp: int) -> KVCacheLayout:
        return KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=max(1, 2 // tp),
                                       head_size=64, total_kv_heads=2)  # fmt: skip

    (src,) = TransferTopology(lay(2), lay(4), RankInfo(1, 2), 4).sources()
    assert src.reason == "remote rank 3 holds heads [1, 2); local rank 1 needs [1, 2); replicated on ranks [2, 3]"
    # decode TP 8 over 2 heads: ranks 4..7 replicate head 1 and all read it from one prefill rank
    assert [TransferTopology(lay(8), lay(1), RankInfo(r, 8), 1).sources()[0].remote_head for r in range(8)] == [
        0, 0, 0, 0, 1, 1, 1, 1,
    ]  # fmt: skip


def test_mamba_refusal_message_and_whole_page_lengths() -> None:
    mamba = KVCacheLayout.mamba(num_layers=2, num_blocks=10, page_size_bytes=4096)
    plan = TransferTopology(mamba, mamba, RankInfo(0, 1), 1).plan([5, 1], [2, 3])
    assert plan.per_rank[0].length.tolist() == [4096] * 4
    with pytest.raises(TopologyError) as err:
        TransferTopology(mamba, mamba, RankInfo(0, 2), 1)
    assert str(err.value) == (
        "tp_size: a mamba page is opaque, so heterogeneous TP (local 2, remote 1) cannot be split per head; "
        "use the same TP size on both sides"
    )


def test_block_lists_are_checked_before_any_descriptor_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_descriptors(*_args: object) -> None:
        raise AssertionError("descriptors were built for an invalid request")

    monkeypatch.setattr(TransferTopology, "_plan_source", no_descriptors)
    topo = TransferTopology(llama(layers=1), llama(layers=1), RankInfo(0, 1), 1)
    for local, remote in [([], []), ([0, 4096], [0, 1]), ([3, 3], [0, 1]), ([0, 1, 2], [0, 1]), ([0, 1], [7, 7])]:
        with pytest.raises(BlockIdError):
            topo.plan(np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64))


def test_plans_and_tables_are_frozen() -> None:
    topo = TransferTopology(llama(layers=2), llama(layers=2), RankInfo(0, 1), 1)
    plan = topo.plan([0, 1], [5, 9])
    (rp,) = plan.per_rank
    for obj, attr in [(topo, "remote_tp_size"), (topo.local_rank, "tp_rank"), (rp.source, "remote_rank"),
                      (rp, "raw_spans"), (plan, "num_chunks")]:  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, 1)
    for arr in (rp.local_offset, rp.remote_offset, rp.length, rp.local_region, rp.pattern_length):
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
    bases = np.array([4096, 8192], dtype=np.uint64)
    table = RegionTable.for_layout(llama(layers=2), bases)
    with pytest.raises(ValueError, match="read-only"):
        table.base[0] = 0
    own = np.array([1, 2], dtype=np.uint64)
    RegionTable(own, own, own)
    own[0] = 7  # the caller's array stays writable


# ----------------------------------------------------------------- generalized layouts (vLLM 0.32 stride orders)
def _triples(rp: RankPlan) -> list[tuple[int, int, int]]:
    return list(zip(rp.local_offset.tolist(), rp.remote_offset.tolist(), rp.length.tolist(), strict=True))


def test_nvfp4_tp1_to_tp2_reads_data_and_scales_of_each_side() -> None:
    def nvfp4(tp: int) -> KVCacheLayout:
        return KVCacheLayout.quantized(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=8 // tp, head_size=128,
                                       dtype="nvfp4", total_kv_heads=8)  # fmt: skip

    topo = TransferTopology(nvfp4(2), nvfp4(1), RankInfo(1, 2), 1)
    (src,) = topo.sources()
    assert (src.remote_rank, src.local_head, src.remote_head, src.num_heads) == (0, 0, 4, 4)
    remote_page, local_page = 18432, 9216
    # remote heads 4..8: K data, K scales, V data, V scales; locally the whole (4-head) page, in the same order
    remote = [4096, 8704, 13312, 17920]
    local, lengths = [0, 4096, 4608, 8704], [4096, 512, 4096, 512]
    (rp,) = topo.plan([0], [2]).per_rank
    assert _triples(rp) == list(zip(local, [2 * remote_page + o for o in remote], lengths, strict=True))
    (rp,) = topo.plan([1, 2, 3], [0, 1, 3]).per_rank
    assert rp.num_descriptors == 3 * 4
    assert sorted(_triples(rp)) == sorted(
        (lb * local_page + lo, rb * remote_page + ro, n)
        for lb, rb in ((1, 0), (2, 1), (3, 3))
        for lo, ro, n in zip(local, remote, lengths, strict=True)
    )
    assert rp.raw_spans == 3 * 4
    assert topo.plan([1, 2, 3], [0, 1, 3]).warnings == ()


def test_lhbnc_run_of_blocks_is_one_descriptor_per_head_per_layer() -> None:
    # per layer [H, B, N, C]: a head's blocks are contiguous, so a run of 5 whole blocks is one span per head
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=4, head_size=64,
                                  heads_outer=True)  # fmt: skip
    plan = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(np.arange(2, 7), np.arange(8, 13))
    (rp,) = plan.per_rank
    assert plan.num_descriptors == 2 * 4
    head = 16 * 4096  # one head's 16 blocks of 16 rows x 256 B
    assert sorted(_triples(rp)[:4]) == [(h * head + 2 * 4096, h * head + 8 * 4096, 5 * 4096) for h in range(4)]
    assert rp.local_region.tolist() == [0] * 4 + [1] * 4
    assert plan.per_block_descriptors == 2 * 5 * 4
    # the whole cache of a layer, in order, is a single span
    assert TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(np.arange(16), np.arange(16)).num_descriptors == 2


def test_bhlnc_all_heads_run_of_blocks_is_one_descriptor() -> None:
    # one region [B, H, L, N, C]: a block holds every head and layer, so a run of blocks is one span
    lay = KVCacheLayout.attention(num_layers=3, num_blocks=16, block_size=16, num_kv_heads=4, head_size=64,
                                  heads_outer=True, cross_layer=True)  # fmt: skip
    block = 4 * 3 * 4096
    plan = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(np.arange(2, 7), np.arange(8, 13))
    assert _triples(plan.per_rank[0]) == [(2 * block, 8 * block, 5 * block)]
    # a head slice (decode TP 2) is one span per head-slice and block: heads are outside the layers
    half = KVCacheLayout.attention(num_layers=3, num_blocks=16, block_size=16, num_kv_heads=2, head_size=64,
                                   heads_outer=True, cross_layer=True, total_kv_heads=4)  # fmt: skip
    plan = TransferTopology(half, lay, RankInfo(1, 2), 1).plan([0, 1], [8, 9])
    assert sorted(_triples(plan.per_rank[0])) == [
        (0, 8 * block + 2 * 3 * 4096, 2 * 3 * 4096), (2 * 3 * 4096, 9 * block + 2 * 3 * 4096, 2 * 3 * 4096)
    ]  # fmt: skip


def _split_or_whole(split: bool, block: int, head: int, half: int) -> int:
    """Offset of 16 rows (``half`` 0: rows 0..15, 1: rows 16..31) of ``head`` in a 32-token HND block of 2 heads."""
    return block * 16384 + (half * 8192 + head * 4096 if split else head * 8192 + half * 4096)


def test_kernel_blocks_move_to_a_side_without_them() -> None:
    # block 32 split into kernel blocks of 16 (2 heads x 16 rows x 256 B = 8192 B each) on the remote side
    split = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=32, num_kv_heads=2, head_size=64,
                                    kernel_block_size=16)  # fmt: skip
    whole = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=32, num_kv_heads=2, head_size=64)
    page = 16384
    for local, remote in ((whole, split), (split, whole)):
        plan = TransferTopology(local, remote, RankInfo(0, 1), 1).plan([0, 1, 2], [4, 5, 6])
        (rp,) = plan.per_rank
        # per block and head: rows 0..15 (kernel block 0) and rows 16..31 (kernel block 1); the last of a block
        # and the first of the next are adjacent on both sides, so 3 blocks are 3 x 4 - 2 descriptors
        units = {
            (_split_or_whole(local is split, b, h, k), _split_or_whole(remote is split, rb, h, k))
            for b, rb in ((0, 4), (1, 5), (2, 6))
            for h in range(2)
            for k in range(2)
        }
        assert plan.per_block_descriptors == 3 * 4
        assert plan.num_descriptors == 3 * 4 - 2
        assert plan.total_bytes == 3 * page
        moved = {(lo + i, ro + i) for lo, ro, n in _triples(rp) for i in range(0, n, 4096)}
        assert moved == units


def test_padded_pages_never_move_padding() -> None:
    def lay(page_stride: int) -> KVCacheLayout:
        return KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64,
                                       page_stride=page_stride)  # fmt: skip

    page = 8192
    for local, remote in ((lay(12288), lay(12288)), (lay(0), lay(12288)), (lay(12288), lay(0))):
        plan = TransferTopology(local, remote, RankInfo(0, 1), 1).plan([0, 1, 2, 3], [4, 5, 6, 7])
        (rp,) = plan.per_rank
        assert plan.num_descriptors == 2 * 4
        assert set(rp.length.tolist()) == {page}
        for offsets, layout in ((rp.local_offset, local), (rp.remote_offset, remote)):
            stride = layout.block_stride
            assert (offsets % stride == 0).all()  # a descriptor is one page, from its start, never its padding
    both = TransferTopology(lay(12288), lay(12288), RankInfo(0, 1), 1).plan([0, 1], [4, 5])
    assert _triples(both.per_rank[0])[:2] == [(0, 4 * 12288, page), (12288, 5 * 12288, page)]
    mamba = KVCacheLayout.mamba(num_layers=1, num_blocks=8, page_size_bytes=1000, page_stride=1024)
    plan = TransferTopology(mamba, mamba, RankInfo(0, 1), 1).plan([0, 1, 2], [3, 4, 5])
    assert _triples(plan.per_rank[0]) == [(0, 3072, 1000), (1024, 4096, 1000), (2048, 5120, 1000)]


def test_kv_planes_heterogeneous_tp_is_one_span_per_token_and_plane_and_warns() -> None:
    def kv(tp: int) -> KVCacheLayout:
        return KVCacheLayout.kv_planes(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=8 // tp, head_size=128,
                                       total_kv_heads=8)  # fmt: skip

    # decode rank 1 of TP 2 holds heads 4..8: in every remote plane row (8 heads x 256 B) the second half
    plan = TransferTopology(kv(2), kv(1), RankInfo(1, 2), 1).plan([0, 1], [3, 4])
    (rp,) = plan.per_rank
    assert plan.num_descriptors == 2 * 2 * 2 * 16  # layers x blocks x planes x tokens
    assert plan.per_block_descriptors == plan.num_descriptors
    assert set(rp.length.tolist()) == {4 * 256}
    remote_row, local_row = 8 * 256, 4 * 256
    assert sorted(_triples(rp)[:64]) == [
        (b * 2 * 16 * local_row + p * 16 * local_row + t * local_row,
         rb * 2 * 16 * remote_row + p * 16 * remote_row + t * remote_row + 4 * 256, 4 * 256)
        for b, rb in ((0, 3), (1, 4)) for p in range(2) for t in range(16)
    ]  # fmt: skip
    assert plan.warnings == ("kv_planes with a head slice: 32 spans per chunk per layer (one per token and plane)",)
    # decode TP 1 from prefill TP 2: each remote rank's row is half of a local row
    plan = TransferTopology(kv(1), kv(2), RankInfo(0, 1), 2).plan([0, 1], [3, 4])
    assert [rp.remote_rank for rp in plan.per_rank] == [0, 1]
    assert plan.num_descriptors == 2 * 2 * 2 * 2 * 16
    layer0 = plan.per_rank[1].local_offset[plan.per_rank[1].local_region == 0]
    assert sorted(layer0.tolist())[:2] == [4 * 256, remote_row + 4 * 256]
    # same TP: whole blocks, no warning
    plan = TransferTopology(kv(1), kv(1), RankInfo(0, 1), 1).plan([0, 1], [3, 4])
    assert (plan.num_descriptors, plan.warnings) == (2, ())


def test_head_size_v_heterogeneous_tp_keeps_a_head_slice_contiguous() -> None:
    def lay(tp: int) -> KVCacheLayout:
        return KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=8 // tp, head_size=128,
                                       head_size_v=64, total_kv_heads=8)  # fmt: skip

    row = (128 + 64) * 2
    plan = TransferTopology(lay(2), lay(1), RankInfo(1, 2), 1).plan([0, 1], [2, 5])
    half = 4 * 16 * row  # heads 4..8 of a remote page; a whole local page
    assert _triples(plan.per_rank[0]) == [(0, 2 * 2 * half + half, half), (half, 5 * 2 * half + half, half)]
    assert plan.warnings == ()
    plain = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
    with pytest.raises(IncompatibleLayoutError, match="head_size_v: local 64, remote "):
        TransferTopology(lay(1), plain, RankInfo(0, 1), 1)


def test_head_size_v_difference_names_both_sizes() -> None:
    v64 = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=8, head_size=128,
                                  head_size_v=64)  # fmt: skip
    plain = KVCacheLayout.attention(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
    assert v64.incompatibilities(plain) == ["head_size_v: local 64, remote 128"]


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 1000])
def test_ids_array_reads_a_repeated_field_as_int64(n: int) -> None:
    from kvxfer.wire import common_pb2
    from kvxfer.wire.convert import ids_array

    ids = [(i * 7919) % 100003 for i in range(n)] + ([2**62] if n else [])
    got = ids_array(common_pb2.BlockList(group="kv", block_ids=ids).block_ids)
    assert got.dtype == np.int64
    assert got.tolist() == ids
