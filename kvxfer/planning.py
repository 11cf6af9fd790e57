"""`kvxfer plan`: what descriptors a transfer needs, and why (pure; no I/O beyond the return value)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError
from kvxfer.layout import CacheKind, DType, KVCacheLayout, Order, head_range
from kvxfer.topology import RankInfo, TransferPlan, TransferTopology


@dataclass(frozen=True)
class ModelShape:
    """A model's cache shape as a user states it (whole model, before tensor parallelism)."""

    kind: CacheKind
    layers: int
    kv_heads: int
    head_size: int
    dtype: DType
    order: Order
    cross_layer: bool
    #: Mamba: the state's parts split over TP ranks, as global byte sizes in page order (``head_size`` unused).
    segments: tuple[int, ...] = ()

    def layout(self, *, tp_size: int, num_blocks: int, block_size: int) -> KVCacheLayout:
        """The per-rank layout of this model at ``tp_size``."""
        if self.kind is CacheKind.MAMBA and self.segments:
            for i, size in enumerate(self.segments):
                if size % tp_size:
                    raise LayoutError(
                        f"segments: segment {i} of {size} bytes does not split evenly over tp_size {tp_size}",
                        field="segments",
                    )
            local = tuple(size // tp_size for size in self.segments)
            return KVCacheLayout.mamba(
                num_layers=self.layers, num_blocks=num_blocks, page_size_bytes=sum(local),
                cross_layer=self.cross_layer, segments=local,
            )  # fmt: skip
        if self.kind is CacheKind.MLA:
            return KVCacheLayout.mla(
                num_layers=self.layers, num_blocks=num_blocks, block_size=block_size, latent_dim=self.head_size,
                dtype=self.dtype, cross_layer=self.cross_layer,
            )  # fmt: skip
        if self.kind is CacheKind.MAMBA:
            return KVCacheLayout.mamba(
                num_layers=self.layers, num_blocks=num_blocks, page_size_bytes=self.head_size,
                cross_layer=self.cross_layer,
            )  # fmt: skip
        h0, h1 = head_range(self.kv_heads, tp_size, 0)
        return KVCacheLayout(
            self.kind, self.layers, num_blocks, block_size, h1 - h0, self.head_size, self.dtype, self.order,
            self.cross_layer, self.kv_heads,
        )  # fmt: skip


def plan_transfer(
    shape: ModelShape,
    *,
    prefill_tp: int,
    decode_tp: int,
    decode_rank: int,
    local_blocks: npt.NDArray[np.int64],
    remote_blocks: npt.NDArray[np.int64],
    block_size: int,
    remote_block_size: int | None = None,
    num_blocks: int | None = None,
    remote_num_blocks: int | None = None,
) -> tuple[TransferTopology, TransferPlan]:
    """Plan a decode rank's pull of one request from the prefill ranks."""
    rbs = remote_block_size or block_size
    local = shape.layout(tp_size=decode_tp, num_blocks=num_blocks or int(local_blocks.max()) + 1, block_size=block_size)
    remote = shape.layout(
        tp_size=prefill_tp, num_blocks=remote_num_blocks or int(remote_blocks.max()) + 1, block_size=rbs
    )
    topo = TransferTopology(local, remote, RankInfo(decode_rank, decode_tp), prefill_tp)
    return topo, topo.plan(local_blocks, remote_blocks)


#: Descriptors of each source that ``kvxfer plan --json`` lists in full.
FIRST = 16


def plan_report(topo: TransferTopology, plan: TransferPlan) -> dict[str, Any]:
    """A JSON-able summary of a plan (the body of ``kvxfer plan --json``)."""
    regions = [
        {"index": r.index, "layers": [r.first_layer, r.first_layer + r.num_layers], "bytes": r.nbytes}
        for r in topo.local.regions()
    ]
    n = plan.num_descriptors
    return {
        "local_layout": topo.local.to_dict(),
        "remote_layout": topo.remote.to_dict(),
        "regions": regions,
        "region_bytes_total": topo.local.total_bytes,
        "sources": [
            {
                "remote_rank": rp.source.remote_rank,
                "local_head": rp.source.local_head,
                "remote_head": rp.source.remote_head,
                "num_heads": rp.source.num_heads,
                "reason": rp.source.reason,
                "descriptors": rp.num_descriptors,
                "bytes": rp.total_bytes,
                # The first descriptors, offsets inside each side's region: what moves where.
                "first": [
                    {
                        "local_region": int(lr),
                        "local_offset": int(lo),
                        "remote_region": int(rr),
                        "remote_offset": int(ro),
                        "length": int(n),
                    }
                    for lr, lo, rr, ro, n in zip(
                        rp.local_region[:FIRST],
                        rp.local_offset[:FIRST],
                        rp.remote_region[:FIRST],
                        rp.remote_offset[:FIRST],
                        rp.length[:FIRST],
                        strict=True,
                    )
                ],
            }
            for rp in plan.per_rank
        ],
        "descriptors": n,
        "bytes": plan.total_bytes,
        "mean_descriptor_bytes": plan.total_bytes / n if n else 0.0,
        "per_block_descriptors": plan.per_block_descriptors,
        "coalescing_ratio": plan.per_block_descriptors / n if n else 0.0,
        "warnings": list(plan.warnings),
    }
