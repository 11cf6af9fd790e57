"""Topologies and rank maps, worked out once per registration and reused by every request."""

from __future__ import annotations

from typing import Any

from kvxfer.layout import KVCacheLayout
from kvxfer.server.identity import remote_sources
from kvxfer.server.state import Registration
from kvxfer.topology import RankInfo, TransferTopology

__all__ = ["TopologyCache"]

#: Topologies kept before the cache starts over (peers with other layouts come and go).
MAX_TOPOLOGIES = 256


class TopologyCache:
    """Caches :class:`TransferTopology` objects and which remote ranks local ranks read.

    A topology depends only on the two layouts and the ranks, so a sidecar plans each once; the
    cache is cleared when the worker registers again (its layouts may have changed).
    """

    def __init__(self) -> None:
        self._topologies: dict[tuple[Any, ...], TransferTopology] = {}
        self._sources: dict[tuple[Any, ...], set[int]] = {}
        self._read_by_all: dict[tuple[Any, ...], set[int]] = {}

    def clear(self) -> None:
        """Forget everything (a new registration)."""
        self._topologies.clear()
        self._sources.clear()
        self._read_by_all.clear()

    def topology(
        self, name: str, local: KVCacheLayout, remote: KVCacheLayout, rank: RankInfo, remote_tp: int
    ) -> TransferTopology:
        """The topology of group ``name`` from ``remote_tp`` remote ranks into ``rank``."""
        key = (name, local, remote, rank, remote_tp)
        topo = self._topologies.get(key)
        if topo is None:
            if len(self._topologies) > MAX_TOPOLOGIES:
                self._topologies.clear()
            topo = self._topologies[key] = TransferTopology(local, remote, rank, remote_tp, rank.pp_size)
        return topo

    def sources(self, name: str, layout: KVCacheLayout, reg: Registration, remote_tp: int) -> set[int]:
        """Remote ranks this rank reads for group ``name`` (from the local layout alone)."""
        key = (name, reg.epoch, remote_tp)
        got = self._sources.get(key)
        if got is None:
            got = self._sources[key] = remote_sources(layout, reg.rank, remote_tp)
        return got

    def read_by_all(self, reg: Registration, remote_tp: int) -> set[int]:
        """Remote ranks that some rank of this instance reads (the others hold unread replicas)."""
        key = (reg.epoch, remote_tp)
        cached = self._read_by_all.get(key)
        if cached is None:
            cached = set()
            for g in reg.groups.values():
                for r in range(reg.rank.tp_size):
                    rank = RankInfo(r, reg.rank.tp_size, reg.rank.pp_rank, reg.rank.pp_size)
                    cached |= remote_sources(g.layout, rank, remote_tp)
            self._read_by_all[key] = cached
        return cached
