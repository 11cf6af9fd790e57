"""Which remote ranks a rank reads, worked out from its own layout before any peer is known.

The sidecar picks the publishers to handshake with, hold and read from this way
(:func:`kvxfer.server.identity.remote_sources`); it must name exactly the ranks the real
topology (built once the publishers' layouts are known) reads, for padded pages too.
"""

from __future__ import annotations

import pytest

from kvxfer.layout import KVCacheLayout
from kvxfer.server.identity import remote_sources
from kvxfer.topology import RankInfo, TransferTopology

TOTAL_HEADS = 8
PAD = 4096  # bytes of slack vLLM leaves after a page (or a block) when groups share one page size


def _rank_layout(tp: int, padding: str) -> KVCacheLayout:
    heads = max(TOTAL_HEADS // tp, 1)

    def attention(**kw: object) -> KVCacheLayout:
        return KVCacheLayout.attention(
            num_layers=2, num_blocks=64, block_size=16, num_kv_heads=heads, total_kv_heads=TOTAL_HEADS,
            head_size=128, dtype="bf16", **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    if padding == "page_stride":
        return attention(page_stride=attention().page_bytes + PAD)
    if padding == "block_bytes":
        return attention(cross_layer=True, block_bytes=2 * attention().page_bytes + PAD)
    return attention()


@pytest.mark.parametrize("padding", ["none", "page_stride", "block_bytes"])
@pytest.mark.parametrize("local_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("remote_tp", [1, 2, 4, 8, 16])
def test_remote_sources_are_the_ranks_the_real_topology_reads(padding: str, local_tp: int, remote_tp: int) -> None:
    local, remote = _rank_layout(local_tp, padding), _rank_layout(remote_tp, padding)
    for r in range(local_tp):
        rank = RankInfo(r, local_tp)
        real = {s.remote_rank for s in TransferTopology(local, remote, rank, remote_tp).sources()}
        assert remote_sources(local, rank, remote_tp) == real, (padding, local_tp, remote_tp, r)
