"""Property tests: a push (every sending rank WRITEs its PushPlan) leaves every receiving rank as a pull would.

The receivers are the pull tests' "local" side and the senders their "remote" side: for each drawn
case every sending rank plans its WRITEs with :class:`kvxfer.topology.PushTopology`, the WRITEs are
applied byte by byte, and each receiving rank must then hold exactly what the naive model says a
pull of the same blocks leaves there, with no receiving byte written twice (replicated heads and MLA
latents come from one replica only) and no byte outside the request touched.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvxfer.errors import TopologyError
from kvxfer.topology import PushTopology, RankInfo, RegionTable, TransferTopology

from .reference import apply_descriptors, expected_after_pull
from .test_topology_reference import Case, _layout, _side, cases, filled_remotes


def run_push(case: Case) -> None:
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    senders, values, send_bufs = filled_remotes(case, rng)
    receivers = [_side(case, case.local, case.local_tp, d) for d in range(case.local_tp)]
    recv_bufs = [rng.integers(0, 256, size=s.buffer_bytes(), dtype=np.uint8) for s in receivers]
    sb, rb = np.array(case.remote_blocks), np.array(case.local_blocks)
    expected = [
        expected_after_pull(s, b, values, rb, sb, case.remote.tokens) for s, b in zip(receivers, recv_bufs, strict=True)
    ]
    recv_layouts = tuple(_layout(case, s) for s in receivers)
    recv_tables = [RegionTable.for_layout(lay, s.bases()) for lay, s in zip(recv_layouts, receivers, strict=True)]
    written = [np.zeros(b.size, dtype=np.int32) for b in recv_bufs]
    total = 0
    for q, side in enumerate(senders):
        send_layout = _layout(case, side)
        topo = PushTopology(send_layout, recv_layouts, RankInfo(q, case.remote_tp))
        plan = topo.plan(sb, rb)
        assert plan.targets == topo.targets
        table = RegionTable.for_layout(send_layout, side.bases())
        for d in plan.targets:
            sdesc, rdesc = plan.write_descriptors(d, table, recv_tables[d])
            assert sdesc.shape == rdesc.shape
            assert np.array_equal(sdesc[:, 1], rdesc[:, 1])
            for a, n, _ in rdesc.tolist():
                written[d][a : a + n] += 1
            apply_descriptors(recv_bufs[d], send_bufs[q], rdesc, sdesc)
        total += plan.total_bytes
    for d in range(case.local_tp):
        assert written[d].max() <= 1, f"receiving rank {d}: a byte written twice"
        np.testing.assert_array_equal(recv_bufs[d], expected[d])
    # As many bytes as the receivers' own pulls would move, no more.
    pulled = sum(
        TransferTopology(recv_layouts[d], _layout(case, senders[0]), RankInfo(d, case.local_tp), case.remote_tp)
        .plan(rb, sb).total_bytes
        for d in range(case.local_tp)
    )  # fmt: skip
    assert total == pulled


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_push_leaves_every_receiver_as_a_pull_would(case: Case) -> None:
    run_push(case)


def test_replicated_heads_are_written_once_per_receiving_rank() -> None:
    # 2 heads, sender TP 4 (each head on two ranks), receiver TP 1: the receiver reads head 0 from
    # rank 0 and head 1 from rank 2 (its own rank 0 picks the first replica): ranks 1 and 3 write nothing.
    from kvxfer.layout import KVCacheLayout

    def lay(heads: int) -> KVCacheLayout:
        return KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=heads,
                                       total_kv_heads=2, head_size=8, dtype="bf16")  # fmt: skip

    writes = {q: PushTopology(lay(1), (lay(2),), RankInfo(q, 4)).targets for q in range(4)}
    assert writes == {0: (0,), 1: (), 2: (0,), 3: ()}
    empty = PushTopology(lay(1), (lay(2),), RankInfo(1, 4)).plan([1, 2], [3, 4])
    assert (empty.targets, empty.total_bytes) == ((), 0)
    with pytest.raises(TopologyError, match=r"target: this sender writes nothing into rank 0 \(it writes \(\)\)"):
        empty.write_descriptors(0, RegionTable.for_layout(lay(1), [4096, 8192]),
                                RegionTable.for_layout(lay(2), [4096, 8192]))  # fmt: skip
    with pytest.raises(TopologyError, match="receivers: at least one"):
        PushTopology(lay(1), (), RankInfo(0, 4))
