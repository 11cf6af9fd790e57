"""TransferTopology: which bytes move where, as vectorized descriptor arrays.

Given the local and remote layouts of one cache group, the ranks on each side and the block ids
of one request, :class:`TransferTopology` answers which remote ranks the local rank reads, which
head slice each contributes and where it lands in the local page, and builds the descriptors: one
per maximal run that is contiguous on *both* sides and inside one region on each side.

The construction is pure numpy. A transfer is a grid ``layers x chunks x units``:

* a *chunk* is the largest token range that lies inside one block on both sides
  (``min(local block_size, remote block_size)`` tokens);
* a *unit* is the largest byte span inside a chunk that is contiguous on both sides for one
  source (a head slice of a whole HND block, one token of an NHD block, a side's data or scales
  of an nvfp4 head slice, or one row when the two sides order heads and tokens differently).

Units are computed once per topology from the layouts' planes (:attr:`KVCacheLayout.planes`)
for each *phase* (which slice of the larger block a chunk is, when block sizes differ); runs of
chunks whose single unit continues on both sides are merged on the block lists alone, and
otherwise the units of every chunk are sorted and merged wherever they are adjacent on both
sides (e.g. every layer of a block-major block, or a head's run of blocks when heads lie outside
the blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvxfer.errors import BlockIdError, IncompatibleLayoutError, LayoutError, TopologyError
from kvxfer.layout import CacheKind, KVCacheLayout, Order, Packing, head_range

__all__ = [
    "BlockIds",
    "PushPlan",
    "PushTopology",
    "RankInfo",
    "RankPlan",
    "RegionTable",
    "Source",
    "TransferPlan",
    "TransferTopology",
    "check_block_ids",
    "parse_block_ids",
]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
BlockIds = Sequence[int] | npt.NDArray[np.integer]


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
            object.__setattr__(self, name, _frozen(getattr(self, name)))

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
        return _frozen(np.repeat(self.group_local_region, self.pattern_length.size))

    @cached_property
    def local_offset(self) -> I64:
        """Byte offset of every local descriptor inside its region."""
        return _frozen((self.group_local_offset[:, None] + self.pattern_local_offset[None, :]).ravel())

    @cached_property
    def remote_region(self) -> I64:
        """Region index of every remote descriptor."""
        return _frozen(np.repeat(self.group_remote_region, self.pattern_length.size))

    @cached_property
    def remote_offset(self) -> I64:
        """Byte offset of every remote descriptor inside its region."""
        return _frozen((self.group_remote_offset[:, None] + self.pattern_remote_offset[None, :]).ravel())

    @cached_property
    def length(self) -> I64:
        """Length of every descriptor (the same on both sides)."""
        return _frozen(np.tile(self.pattern_length, self.group_local_region.size))

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


#: The most block ids :func:`parse_block_ids` expands a spec to (a typo must not exhaust memory).
MAX_PARSED_IDS = 1 << 24


def parse_block_ids(spec: str, *, name: str = "blocks") -> I64:
    """Parse ``"0:2048"``, ``"3,4,5,9"`` or ``"0:8,20:24"`` into an int64 array (ranges are half-open).

    Errors are :class:`BlockIdError` on field ``name``, naming the part that could not be used.
    """
    parts: list[I64] = []
    count = 0
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        lo, colon, hi = item.partition(":")
        try:
            start, stop = int(lo), int(hi) if colon else int(lo) + 1
        except ValueError:
            raise BlockIdError(f"{name}: cannot parse {item!r} (use 'a:b' ranges or ids separated by commas)",
                               field=name) from None  # fmt: skip
        if start < 0:
            raise BlockIdError(f"{name}: block id {start} in {item!r} is negative", field=name)
        if stop <= start:
            raise BlockIdError(f"{name}: the range {item!r} is empty ('a:b' takes ids a to b-1, so a < b)", field=name)
        count += stop - start
        if count > MAX_PARSED_IDS:
            raise BlockIdError(f"{name}: {spec!r} names more than {MAX_PARSED_IDS} block ids", field=name)
        parts.append(np.arange(start, stop, dtype=np.int64))
    if not parts:
        raise BlockIdError(f"{name}: {spec!r} names no block ids", field=name)
    return np.concatenate(parts)


@dataclass(frozen=True)
class TransferTopology:
    """Plans transfers of one cache group from remote ranks into one local rank.

    ``local`` and ``remote`` describe the cache group as each side's rank holds it (per-rank
    head counts). The local rank is the one whose memory receives the bytes: a plan says where each
    of its heads comes from, reading one replica of each. To push (WRITE), plan for every receiving
    rank in turn (each as ``local``) and have the sender execute the plans whose sources are its
    own rank, with the two descriptor arrays' roles swapped: so replicated heads reach every replica.
    """

    local: KVCacheLayout
    remote: KVCacheLayout
    local_rank: RankInfo
    remote_tp_size: int
    remote_pp_size: int = 1

    def __post_init__(self) -> None:
        diffs = self.local.incompatibilities(self.remote)
        if diffs:
            raise IncompatibleLayoutError(diffs)
        if self.remote_pp_size != self.local_rank.pp_size:
            raise TopologyError(
                f"pp_size: local {self.local_rank.pp_size}, remote {self.remote_pp_size}; "
                "both sides must split layers into the same pipeline stages",
                field="pp_size",
            )
        if self.remote_tp_size < 1:
            raise TopologyError(f"remote_tp_size: must be >= 1, got {self.remote_tp_size}", field="remote_tp_size")
        kind = self.local.kind
        if kind is CacheKind.MAMBA and self.remote_tp_size != self.local_rank.tp_size:
            raise TopologyError(
                f"tp_size: a mamba page is opaque, so heterogeneous TP (local {self.local_rank.tp_size}, remote "
                f"{self.remote_tp_size}) cannot be split per head; use the same TP size on both sides",
                field="tp_size",
            )
        if kind in (CacheKind.ATTENTION, CacheKind.QUANTIZED, CacheKind.KV_PLANES):
            total = self.local.total_kv_heads
            for side, layout, tp, rank in (
                ("local", self.local, self.local_rank.tp_size, self.local_rank.tp_rank),
                ("remote", self.remote, self.remote_tp_size, 0),
            ):
                try:
                    h0, h1 = head_range(total, tp, rank)
                except LayoutError as exc:
                    raise TopologyError(f"{side} {exc.message}", field=exc.field) from None
                if h1 - h0 != layout.num_kv_heads:
                    raise TopologyError(
                        f"num_kv_heads: {side} rank holds {layout.num_kv_heads} heads but {total} heads over "
                        f"tp_size {tp} gives {h1 - h0} per rank",
                        field="num_kv_heads",
                    )

    # ------------------------------------------------------------------ ranks and heads
    def sources(self) -> tuple[Source, ...]:
        """Which remote ranks the local rank reads, with each head slice and where it lands."""
        return self._sources

    # What follows depends on the two layouts and the ranks alone, so it is worked out once per
    # topology (a sidecar keeps its topologies) instead of once per request: for a pull of a block or
    # two it was over a third of the planning time.
    @cached_property
    def _sources(self) -> tuple[Source, ...]:
        local_tp, rank = self.local_rank.tp_size, self.local_rank.tp_rank
        if self.local.kind is CacheKind.MLA:
            r = rank % self.remote_tp_size
            return (Source(r, 0, 0, 1, 0, f"MLA latent is replicated on every rank: read it from remote rank {r}"),)
        if self.local.kind is CacheKind.MAMBA:
            return (Source(rank, 0, 0, 1, 0, f"mamba page of rank {rank} (same TP on both sides)"),)
        total = self.local.total_kv_heads
        l0, l1 = head_range(total, local_tp, rank)
        by_range: dict[tuple[int, int], list[int]] = {}
        for q in range(self.remote_tp_size):
            by_range.setdefault(head_range(total, self.remote_tp_size, q), []).append(q)
        out: list[Source] = []
        for (r0, r1), holders in sorted(by_range.items()):
            a, b = max(l0, r0), min(l1, r1)
            if a >= b:
                continue
            # Replicated heads: spread local ranks over the replicas instead of all reading replica 0.
            q = holders[rank % len(holders)]
            why = f"remote rank {q} holds heads [{r0}, {r1}); local rank {rank} needs [{l0}, {l1})"
            if len(holders) > 1:
                why += f"; replicated on ranks {holders}"
            out.append(Source(q, a - l0, a - r0, b - a, a, why))
        return tuple(out)

    # ------------------------------------------------------------------ planning
    def plan(
        self, local_blocks: BlockIds, remote_blocks: BlockIds, *, num_tokens: int | None = None,
        local_skip: int = 0, remote_skip: int = 0,
    ) -> TransferPlan:  # fmt: skip
        """Descriptors moving ``remote_blocks`` of the remote ranks into ``local_blocks`` here.

        Block ids are in each side's own block size. By default both lists cover the same number of
        tokens and all of them move. With ``num_tokens``, tokens ``[local_skip, local_skip +
        num_tokens)`` of the local list receive tokens ``[remote_skip, remote_skip + num_tokens)`` of
        the remote list: the lists may then differ in length, e.g. when the last block of one side
        is partly used or a prefix-cache hit ends inside a block of the other side. Skips must be
        multiples of the smaller block size and fall inside the first block; whole chunks of that
        size move, so a last partial chunk moves whole (its tail is scratch on both sides).

        Raises :class:`BlockIdError` before any descriptor exists if a list is empty, has an id out
        of range, repeats an id, or does not cover the tokens to move.
        """
        lb = check_block_ids(local_blocks, self.local.num_blocks, "local_blocks")
        rb = check_block_ids(remote_blocks, self.remote.num_blocks, "remote_blocks")
        nl, nr = self.local.tokens_per_page, self.remote.tokens_per_page
        g = self._granule
        if num_tokens is None:
            if local_skip or remote_skip:
                raise BlockIdError("num_tokens: needed when tokens are skipped", field="num_tokens")
            if lb.size * nl != rb.size * nr:
                raise BlockIdError(
                    f"remote_blocks: length mismatch: {lb.size} local blocks x {nl} tokens = {lb.size * nl} tokens, "
                    f"{rb.size} remote blocks x {nr} tokens = {rb.size * nr} tokens",
                    field="remote_blocks",
                )
            num_tokens = lb.size * nl
        for name, skip, per in (("local_skip", local_skip, nl), ("remote_skip", remote_skip, nr)):
            if not 0 <= skip < per or skip % g:
                raise BlockIdError(
                    f"{name}: {skip} tokens must be a multiple of {g} (the smaller block size) below the block "
                    f"size {per}",
                    field=name,
                )
        if num_tokens < 1:
            raise BlockIdError(f"num_tokens: must be >= 1, got {num_tokens}", field="num_tokens")
        chunks = -(-num_tokens // g)
        for name, ids, skip, per in (("local_blocks", lb, local_skip, nl), ("remote_blocks", rb, remote_skip, nr)):
            need = -(-(skip + chunks * g) // per)
            if ids.size != need:
                raise BlockIdError(
                    f"{name}: {ids.size} blocks of {per} tokens given; {num_tokens} tokens from token {skip} of the "
                    f"first block take exactly {need}",
                    field=name,
                )
        per_l, per_r = nl // g, nr // g
        if per_l == per_r == 1 and chunks == lb.size:
            # Equal block sizes, every block whole (skips are then 0): chunk c is block c on both
            # sides. The common case, kept to two numpy calls.
            l_start, r_start = lb * self.local.block_stride, rb * self.remote.block_stride
            plans = tuple(self._plan_source(src, l_start, r_start, None) for src in self._sources)
            return TransferPlan(plans, chunks, self.local.num_layers, self._warnings)
        c = np.arange(chunks, dtype=np.int64)
        # Chunk c is the (skip/g + c)-th g-token slice of each side's list; its phase (which slice of the
        # larger block it is) picks the unit pattern.
        li, ri = c + local_skip // g, c + remote_skip // g
        l_start = lb[li // per_l] * self.local.block_stride
        r_start = rb[ri // per_r] * self.remote.block_stride
        if per_l > 1:
            phase: I64 | None = li % per_l
        elif per_r > 1:
            phase = ri % per_r
        else:
            phase = None
        plans = tuple(self._plan_source(src, l_start, r_start, phase) for src in self._sources)
        return TransferPlan(plans, chunks, self.local.num_layers, self._warnings)

    @cached_property
    def _granule(self) -> int:
        """Tokens per chunk: the smaller block size (a chunk lies inside one block on each side)."""
        return min(self.local.tokens_per_page, self.remote.tokens_per_page)

    @cached_property
    def _phases(self) -> int:
        return max(self.local.tokens_per_page, self.remote.tokens_per_page) // self._granule

    @cached_property
    def _both_block_major(self) -> bool:
        # Both caches hold every layer in one region: a block's layers can merge into one span.
        return self.local.cross_layer and self.remote.cross_layer

    @cached_property
    def _patterns(self) -> dict[Source, _Pattern]:
        """Each source's unit patterns per phase (see :meth:`_phase_units`), read-only: shared by every plan."""
        out = {}
        layers = self.local.num_layers if self._both_block_major else 1
        for src in self._sources:
            per_phase = [self._phase_units(src, k, layers) for k in range(self._phases)]
            per_layer = [self._phase_units(src, k, 1) for k in range(self._phases)] if layers > 1 else per_phase
            out[src] = _Pattern.stack(per_phase, [len(p[0]) for p in per_layer])
        return out

    def _phase_units(self, src: Source, phase: int, layers: int) -> tuple[I64, I64, I64]:
        """Units of one chunk in ``phase`` (offsets from each side's block start), coalesced."""
        g = self._granule
        toks = np.arange(g, dtype=np.int64)
        l_tok = toks + (phase * g if self.local.tokens_per_page > g else 0)
        r_tok = toks + (phase * g if self.remote.tokens_per_page > g else 0)
        lo, ln = self.local.row_offsets(np.arange(src.local_head, src.local_head + src.num_heads), l_tok)
        ro, rn = self.remote.row_offsets(np.arange(src.remote_head, src.remote_head + src.num_heads), r_tok)
        if not np.array_equal(ln, rn):  # pragma: no cover - compatible layouts have the same planes
            raise TopologyError("planes: local and remote rows differ in size", field="layout")
        if layers > 1:
            ly = np.arange(layers, dtype=np.int64)
            lo = (ly[:, None] * self.local.layer_stride + lo[None, :]).ravel()
            ro = (ly[:, None] * self.remote.layer_stride + ro[None, :]).ravel()
            ln = np.tile(ln, layers)
        order = np.argsort(lo, kind="stable")
        return _coalesce(lo[order], ro[order], ln[order])

    @cached_property
    def _warnings(self) -> tuple[str, ...]:
        loc, rem = self.local, self.remote
        out: list[str] = []
        for pat in self._patterns.values():
            units = int(pat.layer_units.max())
            if units <= len(loc.planes) or loc.kind in (CacheKind.MLA, CacheKind.MAMBA):
                continue
            if loc.order is Order.NHD and rem.order is Order.NHD:
                out.append(
                    f"NHD with a head slice: {units} spans per chunk per layer (one per token); HND keeps a "
                    "head slice contiguous"
                )
            elif loc.order is not rem.order:
                out.append(f"local {loc.order} vs remote {rem.order}: one span per row ({units} per chunk)")
            elif loc.kind is CacheKind.KV_PLANES:
                out.append(f"kv_planes with a head slice: {units} spans per chunk per layer (one per token and plane)")
            elif Packing.CPU_KT in (loc.packing, rem.packing):
                out.append(
                    f"vLLM's CPU kernel stores K transposed: a block of another size moves as {units} spans per chunk "
                    "per layer (one per head and element of K); equal block sizes move whole pages"
                )
        return tuple(dict.fromkeys(out))

    @cached_property
    def _layer_group_arrays(self) -> tuple[I64, I64, I64, I64]:
        """Region and offset of every layer's pages on each side (used when layers do not merge)."""
        layers = np.arange(self.local.num_layers, dtype=np.int64)
        lr, lo = _layer_groups(self.local, layers)
        rr, ro = _layer_groups(self.remote, layers)
        return _frozen(lr), _frozen(lo), _frozen(rr), _frozen(ro)

    def _plan_source(self, src: Source, l_start: I64, r_start: I64, phase: I64 | None) -> RankPlan:
        pat = self._patterns[src]
        raw_spans = int(pat.layer_units[0]) * l_start.size if phase is None else int(pat.layer_units[phase].sum())
        lo, ro, ln = pat.expand(l_start, r_start, phase)
        if self._both_block_major:
            zero = np.zeros(1, np.int64)
            return RankPlan(src, raw_spans, zero, zero, zero, zero, lo, ro, ln)
        # At least one side has a region per layer, so layers never merge and every layer repeats
        # one pattern at its own region and offset.
        return RankPlan(src, raw_spans, *self._layer_group_arrays, lo, ro, ln)


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


@dataclass(frozen=True, eq=False)
class _Pattern:
    """Unit patterns of one source, one row per phase, padded with zero-length units."""

    local: I64  # (phases, units)
    remote: I64
    length: I64
    count: I64  # units per phase
    layer_units: I64  # units of one layer per phase, before layers merge (per-block span counts)

    @classmethod
    def stack(cls, phases: list[tuple[I64, I64, I64]], layer_units: list[int]) -> _Pattern:
        width = max(len(p[0]) for p in phases)
        arrays = [np.zeros((len(phases), width), np.int64) for _ in range(3)]
        for k, unit in enumerate(phases):
            for a, v in zip(arrays, unit, strict=True):
                a[k, : len(v)] = v
        count = np.array([len(p[0]) for p in phases], np.int64)
        local, remote, length = (_frozen(a) for a in arrays)
        return cls(local, remote, length, _frozen(count), _frozen(np.array(layer_units, np.int64)))

    def expand(self, l_start: I64, r_start: I64, phase: I64 | None) -> tuple[I64, I64, I64]:
        """Every chunk's units at its block starts, merged where contiguous on both sides."""
        if phase is None and self.count[0] == 1:
            # One unit per chunk (a head slice of HND blocks, whole pages...): merge runs of chunks, in
            # local address order (freed blocks often come back in descending order).
            if l_start.size > 1 and (l_start[1:] < l_start[:-1]).any():
                order = np.argsort(l_start, kind="stable")
                l_start, r_start = l_start[order], r_start[order]
            return _merge_runs(l_start + self.local[0, 0], r_start + self.remote[0, 0], int(self.length[0, 0]))
        rows = np.zeros(l_start.size, np.int64) if phase is None else phase
        lo = l_start[:, None] + self.local[rows]
        ro = r_start[:, None] + self.remote[rows]
        ln = self.length[rows]
        if self.count.min() != self.local.shape[1]:
            keep = ln > 0
            lo, ro, ln = lo[keep], ro[keep], ln[keep]
        lo, ro, ln = lo.ravel(), ro.ravel(), ln.ravel()
        if lo.size > 1 and (lo[1:] < lo[:-1]).any():
            # e.g. heads outside the blocks: a head's blocks are contiguous, chunk order is not.
            order = np.argsort(lo, kind="stable")
            lo, ro, ln = lo[order], ro[order], ln[order]
        return _coalesce(lo, ro, ln)


def _layer_groups(layout: KVCacheLayout, layers: I64) -> tuple[I64, I64]:
    """Region and offset of each layer's block 0: its own region, or its slot in a block-major block."""
    if layout.cross_layer:
        return np.zeros_like(layers), layers * layout.layer_stride
    return layers, np.zeros_like(layers)


def _merge_runs(l_start: I64, r_start: I64, unit: int) -> tuple[I64, I64, I64]:
    """Merge consecutive chunks whose single unit continues on both sides; returns starts and lengths."""
    if l_start.size <= 1:
        return l_start, r_start, np.full(l_start.size, unit, np.int64)
    brk = np.empty(l_start.size + 1, dtype=bool)
    brk[0] = brk[-1] = True  # the first chunk starts a run; the sentinel ends the last one
    np.not_equal(l_start[1:], l_start[:-1] + unit, out=brk[1:-1])
    brk[1:-1] |= r_start[1:] != r_start[:-1] + unit
    bounds = brk.nonzero()[0]
    if bounds.size == l_start.size + 1:  # nothing merges (scattered blocks): keep the arrays
        return l_start, r_start, np.full(l_start.size, unit, np.int64)
    starts = bounds[:-1]
    return l_start[starts], r_start[starts], (bounds[1:] - starts) * unit


def _coalesce(lo: I64, ro: I64, ln: I64) -> tuple[I64, I64, I64]:
    """Merge neighbours that are contiguous on both sides (all spans lie in one region per side)."""
    if lo.size <= 1:
        return lo, ro, ln
    brk = np.empty(lo.size, dtype=bool)
    brk[0] = True
    np.not_equal(lo[1:], lo[:-1] + ln[:-1], out=brk[1:])
    brk[1:] |= ro[1:] != ro[:-1] + ln[:-1]
    starts = np.flatnonzero(brk)
    if starts.size == lo.size:
        return lo, ro, ln
    return lo[starts], ro[starts], np.add.reduceat(ln, starts)


def check_block_ids(ids: BlockIds, num_blocks: int, name: str) -> I64:
    """``ids`` as int64: a flat, non-empty list in ``[0, num_blocks)`` without repeats, else a
    BlockIdError naming ``name`` and the first bad id (and its position)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise BlockIdError(f"{name}: expected a flat list of block ids, got shape {arr.shape}", field=name)
    if arr.size == 0:
        raise BlockIdError(f"{name}: empty block list", field=name)
    if arr.dtype.kind not in "iu":
        raise BlockIdError(f"{name}: block ids must be integers, got dtype {arr.dtype}", field=name)
    arr = arr.astype(np.int64, copy=False)
    # One sort answers both checks (its ends are the extremes); the details only once one fails.
    srt = np.sort(arr) if arr.size > 1 else arr
    if srt[0] < 0 or srt[-1] >= num_blocks:
        bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
        i = int(bad[0])
        raise BlockIdError(
            f"{name}: block id {int(arr[i])} at position {i} is out of range [0, {num_blocks})"
            + (f" ({bad.size} ids out of range)" if bad.size > 1 else ""),
            field=name,
        )
    if arr.size > 1 and (srt[1:] == srt[:-1]).any():
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        raise BlockIdError(f"{name}: block id {int(srt[dup[0]])} appears more than once", field=name)
    return arr


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


def _frozen(a: npt.ArrayLike) -> I64:
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and not a.flags.writeable and a.flags.c_contiguous:
        return a  # already read-only (e.g. a topology's cached pattern): share it
    # A new view, so that a caller's own array keeps its flags.
    arr = np.ascontiguousarray(a, dtype=np.int64).view()
    arr.flags.writeable = False
    return arr
