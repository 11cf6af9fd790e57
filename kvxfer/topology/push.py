"""PushTopology: the WRITEs of one sending rank, as the receiving ranks' pull plans restricted to it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvxfer.errors import TopologyError
from kvxfer.layout import KVCacheLayout
from kvxfer.topology.blocks import BlockIds
from kvxfer.topology.plans import PushPlan, RankInfo, RankPlan
from kvxfer.topology.transfer import TransferTopology

__all__ = ["PushTopology"]


@dataclass(frozen=True)
class PushTopology:
    """Plans the WRITEs of one sending rank of a cache group into every receiving rank (push mode).

    Who sends what is what the receivers would read: each receiving rank takes each head from one
    replica (:meth:`TransferTopology.sources`), so a sender writes exactly the spans those plans take
    from it. Over all senders every receiving byte is written once, replicated heads and MLA latents
    included, with the pull path's coalescing and its block-size and TP rules.
    """

    sender: KVCacheLayout
    #: Each receiving TP rank's layout, in rank order (they differ only in their head counts).
    receivers: tuple[KVCacheLayout, ...]
    sender_rank: RankInfo

    def __post_init__(self) -> None:
        if not self.receivers:
            raise TopologyError("receivers: at least one receiving rank is needed", field="receivers")
        _ = self._readers  # every receiving rank's topology is checked now, not at the first request

    @cached_property
    def _readers(self) -> tuple[TransferTopology, ...]:
        tp, me = len(self.receivers), self.sender_rank
        return tuple(
            TransferTopology(lay, self.sender, RankInfo(d, tp, me.pp_rank, me.pp_size), me.tp_size, me.pp_size)
            for d, lay in enumerate(self.receivers)
        )

    @cached_property
    def targets(self) -> tuple[int, ...]:
        """The receiving ranks this sender writes into (a replica of a head writes only where it is read)."""
        me = self.sender_rank.tp_rank
        return tuple(d for d, t in enumerate(self._readers) if any(s.remote_rank == me for s in t.sources()))

    def plan(
        self, sender_blocks: BlockIds, receiver_blocks: BlockIds, *, num_tokens: int | None = None,
        sender_skip: int = 0, receiver_skip: int = 0,
    ) -> PushPlan:  # fmt: skip
        """The WRITEs moving ``sender_blocks`` here into ``receiver_blocks`` of every receiving rank.

        Arguments as :meth:`TransferTopology.plan`, seen from the sender; block lists are checked
        before any descriptor exists.
        """
        me = self.sender_rank.tp_rank
        per_target: list[tuple[int, RankPlan]] = []
        chunks = layers = 0
        for d in self.targets:
            p = self._readers[d].plan(receiver_blocks, sender_blocks, num_tokens=num_tokens, local_skip=receiver_skip,
                                      remote_skip=sender_skip)  # fmt: skip
            per_target += [(d, rp) for rp in p.per_rank if rp.remote_rank == me]
            chunks, layers = p.num_chunks, p.num_layers
        return PushPlan(tuple(per_target), chunks, layers)
