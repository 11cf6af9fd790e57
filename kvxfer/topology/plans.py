"""What a plan is: ranks, region tables, the descriptors of one remote rank and their resolution.

A :class:`RankPlan` holds descriptors relative to regions (region index and offset, as a grid of
layer groups times a per-request pattern); :meth:`RankPlan.descriptors` resolves them against each
side's :class:`RegionTable` into the ``(N, 3)`` address, length, device arrays a data plane takes,
checking every one against its region's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError, TopologyError
from kvxfer.layout import KVCacheLayout
from kvxfer.topology.blocks import I64

__all__ = ["U64", "PushPlan", "RankInfo", "RankPlan", "RegionIndex", "RegionTable", "Source", "TransferPlan", "frozen"]

U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class RankInfo:
    """A worker's place in the parallel layout."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name}: must be >= 1, got {getattr(self, name)}", field=name)
        if not 0 <= self.tp_rank < self.tp_size:
            raise TopologyError(f"tp_rank: {self.tp_rank} is not in [0, {self.tp_size})", field="tp_rank")
        if not 0 <= self.pp_rank < self.pp_size:
            raise TopologyError(f"pp_rank: {self.pp_rank} is not in [0, {self.pp_size})", field="pp_rank")


@dataclass(frozen=True, eq=False)
class RegionTable:
    """Registered memory of one rank: base address, size and device id of each region."""

    base: U64
    size: U64
    device: U64

    def __post_init__(self) -> None:
        arrays = {n: np.ascontiguousarray(getattr(self, n), dtype=np.uint64).view() for n in ("base", "size", "device")}
        if len({a.shape for a in arrays.values()}) != 1 or arrays["base"].ndim != 1:
            raise LayoutError("regions: base, size and device must be 1-D arrays of one length", field="regions")
        for n, a in arrays.items():
            a.flags.writeable = False
            object.__setattr__(self, n, a)

    @classmethod
    def for_layout(cls, layout: KVCacheLayout, bases: Sequence[int] | npt.ArrayLike, device: int = 0) -> RegionTable:
        """Regions of ``layout`` at ``bases`` (one address per region) on ``device``."""
        b = np.asarray(bases, dtype=np.uint64).reshape(-1)
        if b.size != layout.num_regions:
            raise LayoutError(
                f"regions: the layout has {layout.num_regions} regions, got {b.size} base addresses", field="regions"
            )
        size = np.full(b.size, layout.region_bytes, dtype=np.uint64)
        return cls(b, size, np.full(b.size, device, dtype=np.uint64))

    def check_layout(self, layout: KVCacheLayout) -> None:
        """Refuse a table that does not match ``layout`` (count or size of regions)."""
        if len(self.base) != layout.num_regions:
            raise LayoutError(
                f"regions: {len(self.base)} regions registered, the layout has {layout.num_regions}", field="regions"
            )
        small = np.flatnonzero(self.size < layout.region_bytes)
        if small.size:
            i = int(small[0])
            raise LayoutError(
                f"regions: region {i} has {int(self.size[i])} bytes, the layout needs {layout.region_bytes}",
                field="regions",
            )


@dataclass(frozen=True, eq=False)
class RegionIndex:
    """Finds, for byte spans, a registered region each one lies in.

    Regions may overlap: the groups of a block-major cache that share one allocation are
    registered as regions with the same base and different sizes. A span lies in some region
    exactly when it lies in the one that reaches furthest among those starting at or before it,
    so that is the one :meth:`find` answers (a smaller region at the same base would refuse the
    span's tail; every region of one allocation gives the same address for it).
    """

    bases: U64  # by region index
    ends: U64  # by region index
    sorted_bases: U64
    furthest: npt.NDArray[np.intp]  # per position in ``sorted_bases``: the region reaching furthest up to it

    @classmethod
    def of(cls, bases: npt.ArrayLike, sizes: npt.ArrayLike) -> RegionIndex:
        """The index of regions ``bases[i]`` .. ``bases[i] + sizes[i]`` (any order, overlaps allowed)."""
        b = np.asarray(bases, dtype=np.uint64).reshape(-1)
        e = b + np.asarray(sizes, dtype=np.uint64).reshape(-1)
        order = np.argsort(b, kind="stable")
        ends = e[order]
        reach = np.maximum.accumulate(ends) if ends.size else ends
        # The latest position that set the running maximum: the region that reaches furthest so far.
        at = np.maximum.accumulate(np.where(ends == reach, np.arange(ends.size), 0)) if ends.size else order
        return cls(b, e, b[order], order[at])

    def find(self, addr: U64, size: U64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        """Per span (``addr``, ``size``): a region it lies in, and whether it lies in one at all
        (where it does not, the region given is meaningless)."""
        addr = addr.astype(np.uint64, copy=False)  # mixed with int64, numpy would compute in float64
        size = size.astype(np.uint64, copy=False)
        if not self.sorted_bases.size:
            return np.zeros(addr.shape, dtype=np.intp), np.zeros(addr.shape, dtype=bool)
        at = np.searchsorted(self.sorted_bases, addr, side="right") - 1
        region = self.furthest[np.maximum(at, 0)]
        end = self.ends[region]
        # No sum that could wrap: the span starts in the region and fits in what is left of it.
        return region, (at >= 0) & (addr < end) & (size <= end - addr)


@dataclass(frozen=True)
class Source:
    """One remote rank that the local rank reads, and the head slice it contributes.

    ``local_head`` and ``remote_head`` are the first head of the slice in each side's page;
    ``num_heads`` heads are read (plus their V-group twins in a quantized cache).
    """

    remote_rank: int
    local_head: int
    remote_head: int
    num_heads: int
    global_head: int
    reason: str


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Descriptors for one remote rank, relative to regions (resolve with :meth:`descriptors`).

    ``raw_spans`` counts the spans of one layer of the request before any run of blocks merged
    (what a scheme of one descriptor per block and layer would issue).

    Stored factored: descriptor ``(i, j)`` is *group* ``i`` (a region and a byte offset on each
    side: one group per layer, or a single group when both caches are block-major) plus *pattern*
    entry ``j`` (offsets and length inside it), group-major. Descriptors of different layers never
    merge unless both sides are block-major, so the pattern is built and coalesced once per request
    and only the resolved arrays have the full ``groups x pattern`` size.
    """

    source: Source
    raw_spans: int
    group_local_region: I64
    group_local_offset: I64
    group_remote_region: I64
    group_remote_offset: I64
    pattern_local_offset: I64
    pattern_remote_offset: I64
    pattern_length: I64

    def __post_init__(self) -> None:
        for name in _RANK_PLAN_ARRAYS:
            object.__setattr__(self, name, frozen(getattr(self, name)))

    @property
    def remote_rank(self) -> int:
        """The remote TP rank these descriptors read from."""
        return self.source.remote_rank

    @property
    def num_descriptors(self) -> int:
        """How many descriptors (on each side)."""
        return int(self.group_local_region.size * self.pattern_length.size)

    @property
    def total_bytes(self) -> int:
        """Bytes moved from this rank."""
        return int(self.group_local_region.size) * int(self.pattern_length.sum())

    @cached_property
    def local_region(self) -> I64:
        """Region index of every local descriptor."""
        return frozen(np.repeat(self.group_local_region, self.pattern_length.size))

    @cached_property
    def local_offset(self) -> I64:
        """Byte offset of every local descriptor inside its region."""
        return frozen((self.group_local_offset[:, None] + self.pattern_local_offset[None, :]).ravel())

    @cached_property
    def remote_region(self) -> I64:
        """Region index of every remote descriptor."""
        return frozen(np.repeat(self.group_remote_region, self.pattern_length.size))

    @cached_property
    def remote_offset(self) -> I64:
        """Byte offset of every remote descriptor inside its region."""
        return frozen((self.group_remote_offset[:, None] + self.pattern_remote_offset[None, :]).ravel())

    @cached_property
    def length(self) -> I64:
        """Length of every descriptor (the same on both sides)."""
        return frozen(np.tile(self.pattern_length, self.group_local_region.size))

    def descriptors(self, local: RegionTable, remote: RegionTable) -> tuple[U64, U64]:
        """``(local, remote)`` arrays of shape (N, 3): address, length, device id (uint64).

        Every descriptor is checked to lie inside its registered region on both sides.
        """
        return (
            _resolve(local, self.group_local_region, self.group_local_offset, self.pattern_local_offset,
                     self.pattern_length, "local"),
            _resolve(remote, self.group_remote_region, self.group_remote_offset, self.pattern_remote_offset,
                     self.pattern_length, "remote"),
        )  # fmt: skip


#: RankPlan's array fields (every field after ``source`` and ``raw_spans``), looked up once: a plan is
#: built on every pull's critical path.
_RANK_PLAN_ARRAYS = tuple(f.name for f in fields(RankPlan)[2:])


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """All descriptors of one request for one local rank."""

    per_rank: tuple[RankPlan, ...]
    num_chunks: int
    num_layers: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def num_descriptors(self) -> int:
        """Total descriptors over all remote ranks."""
        return sum(p.num_descriptors for p in self.per_rank)

    @property
    def total_bytes(self) -> int:
        """Total bytes moved."""
        return sum(p.total_bytes for p in self.per_rank)

    @property
    def per_block_descriptors(self) -> int:
        """Descriptors a scheme without coalescing would issue: the spans of every block, layer and source."""
        return self.num_layers * sum(p.raw_spans for p in self.per_rank)


@dataclass(frozen=True, eq=False)
class PushPlan:
    """The WRITEs of one sending rank for one request: a :class:`RankPlan` per receiving rank it writes.

    Each plan is the receiving rank's pull plan restricted to this sender (its "local" side is the
    receiver's memory, its "remote" side the sender's); :meth:`write_descriptors` swaps them for a WRITE.
    """

    per_target: tuple[tuple[int, RankPlan], ...]
    num_chunks: int
    num_layers: int

    @property
    def targets(self) -> tuple[int, ...]:
        """Receiving TP ranks written, ascending."""
        return tuple(d for d, _ in self.per_target)

    @property
    def num_descriptors(self) -> int:
        """Total descriptors over every receiving rank."""
        return sum(rp.num_descriptors for _, rp in self.per_target)

    @property
    def total_bytes(self) -> int:
        """Total bytes written."""
        return sum(rp.total_bytes for _, rp in self.per_target)

    def write_descriptors(self, target: int, sender: RegionTable, receiver: RegionTable) -> tuple[U64, U64]:
        """``(sender, receiver)`` (N, 3) arrays of the WRITE into receiving rank ``target``."""
        for d, rp in self.per_target:
            if d == target:
                into, out_of = rp.descriptors(receiver, sender)
                return out_of, into
        raise TopologyError(f"target: this sender writes nothing into rank {target} (it writes {self.targets})",
                            field="target")  # fmt: skip


def _resolve(table: RegionTable, g_region: I64, g_offset: I64, p_offset: I64, p_length: I64, side: str) -> U64:
    """Addresses of the ``groups x pattern`` descriptors, each checked against its region's size."""
    # ndarray methods rather than the np.* wrappers, as few calls as can be, and the error details
    # only once a check fails: a pull of one block resolves a handful of descriptors, where numpy's
    # per-call cost dominates. Region ids come from a layout, never negative: take() refuses the
    # ones past the table.
    groups, per = g_region.size, p_offset.size
    if groups == 0 or per == 0:
        return np.empty((0, 3), dtype=np.uint64)
    try:
        size = table.size.take(g_region)
    except IndexError:
        raise LayoutError(
            f"regions: {side} descriptors need region {int(g_region.max())}, only {table.base.size} registered",
            field="regions",
        ) from None
    p_end = p_offset + p_length
    # One comparison per group: the furthest byte any pattern entry reaches in it.
    reach = (g_offset + p_end.max()).view(np.uint64)
    if (reach > size).any():
        i = int(np.flatnonzero(reach > size)[0])
        j = int(np.flatnonzero((g_offset[i] + p_end).astype(np.uint64) > size[i])[0])
        r = int(g_region[i])
        raise LayoutError(
            f"regions: {side} descriptor [{int(g_offset[i] + p_offset[j])}, {int(g_offset[i] + p_end[j])}) overruns "
            f"region {r} of {int(table.size[r])} bytes",
            field="regions",
        )
    out = np.empty((groups, per, 3), dtype=np.uint64)
    base = table.base.take(g_region) + g_offset.view(np.uint64)
    np.add(base[:, None], p_offset.view(np.uint64), out=out[:, :, 0])
    out[:, :, 1] = p_length.view(np.uint64)
    out[:, :, 2] = table.device.take(g_region)[:, None]
    return out.reshape(-1, 3)


def frozen(a: npt.ArrayLike) -> I64:
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and not a.flags.writeable and a.flags.c_contiguous:
        return a  # already read-only (e.g. a topology's cached pattern): share it
    # A new view, so that a caller's own array keeps its flags.
    arr = np.ascontiguousarray(a, dtype=np.int64).view()
    arr.flags.writeable = False
    return arr
