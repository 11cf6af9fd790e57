"""The handshake's checks for Mamba state split over TP: matching splits pass across TP sizes, others are refused."""

from __future__ import annotations

from kvxfer import PROTOCOL_VERSION
from kvxfer.layout import KVCacheLayout
from kvxfer.server.identity import Identity, reader_differences, remote_sources
from kvxfer.topology import RankInfo, TransferTopology

# Mamba2 in vLLM's DS conv layout, global bytes: x, B, C of the conv state, then the SSM state.
GLOBAL = (3 * 2 * 128, 3 * 2 * 32, 3 * 2 * 32, 16 * 64 * 4)


def mamba(tp: int, segments: tuple[int, ...] = GLOBAL, **kw: object) -> KVCacheLayout:
    local = tuple(s // tp for s in segments)
    return KVCacheLayout.mamba(num_layers=2, num_blocks=32, page_size_bytes=sum(local), segments=local,
                               **kw)  # type: ignore[arg-type]  # fmt: skip


def identity(role: str, rank: RankInfo, layout: KVCacheLayout) -> Identity:
    return Identity(PROTOCOL_VERSION, role, f"{role}-i", 1, rank, {"g1": layout}, "nixl", "agent", b"", "", role)


def test_matching_splits_pass_across_tp_sizes() -> None:
    for d_tp, p_tp in [(1, 2), (2, 1), (4, 2), (2, 4), (8, 1), (2, 2)]:
        for d in range(d_tp):
            reader = identity("decode", RankInfo(d, d_tp), mamba(d_tp, page_stride=8192))
            publisher = identity("prefill", RankInfo(0, p_tp), mamba(p_tp))
            assert reader_differences(reader, publisher) == [], (d_tp, p_tp)


def test_mismatched_splits_are_refused_with_the_reason() -> None:
    reader = identity("decode", RankInfo(0, 2), mamba(2))
    other_count = identity("prefill", RankInfo(0, 1), mamba(1, (*GLOBAL[:3], GLOBAL[3] // 2, GLOBAL[3] // 2)))
    assert reader_differences(reader, other_count) == [
        "group 'g1': segments: local 4 segments [384, 96, 96, 2048], remote 5 segments [768, 192, 192, 2048, 2048] "
        "(the mamba states are split differently)"
    ]
    other_size = identity("prefill", RankInfo(0, 1), mamba(1, (GLOBAL[0] + 2, GLOBAL[1] - 2, *GLOBAL[2:])))
    assert reader_differences(reader, other_size) == [
        "group 'g1': segments: segment 0 of the mamba state is 384 bytes per rank x local tp_size 2 = 768 bytes, but "
        "770 bytes per rank x remote tp_size 1 = 770 bytes (local segments [384, 96, 96, 2048], remote [770, 190, 192, "
        "4096])"
    ]
    opaque = KVCacheLayout.mamba(num_layers=2, num_blocks=32, page_size_bytes=sum(GLOBAL))
    assert reader_differences(reader, identity("prefill", RankInfo(0, 1), opaque)) == [
        "group 'g1': page_size_bytes: local 2624, remote 5248 (the remote page has no TP segments: it moves whole, "
        "between equal TP sizes only)"
    ]


def test_remote_sources_are_the_ranks_the_real_topology_reads() -> None:
    for d_tp in (1, 2, 4, 8):
        for p_tp in (1, 2, 4, 8):
            for d in range(d_tp):
                rank = RankInfo(d, d_tp)
                local = mamba(d_tp, page_stride=8192)
                real = {s.remote_rank for s in TransferTopology(local, mamba(p_tp), rank, p_tp).sources()}
                assert remote_sources(local, rank, p_tp) == real
