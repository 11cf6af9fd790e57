"""TransferTopology: which bytes move where, as vectorized descriptor arrays.

Given the local and remote layouts of one cache group, the ranks on each side and the block ids
of one request, :class:`TransferTopology` answers which remote ranks the local rank reads, which
head slice each contributes and where it lands in the local page, and builds the descriptors: one
per maximal run that is contiguous on *both* sides and inside one region on each side.

The construction is pure numpy. A transfer is a grid ``layers x chunks x units``:

* a *chunk* is the largest token range that lies inside one block on both sides
  (``min(local block_size, remote block_size)`` tokens);
* a *unit* is the largest byte span inside a chunk that is contiguous on both sides for one
  source (a head slice of a whole HND block, one token of an NHD block, or one row when the two
  sides order heads and tokens differently).

Units of one chunk are merged once (the pattern is the same for every chunk), runs of chunks
whose units follow each other on both sides are merged on the block lists alone, and a final
pass merges whatever else is adjacent (e.g. every layer of a cross-layer block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvxfer.errors import BlockIdError, IncompatibleLayoutError, LayoutError, TopologyError
from kvxfer.layout import CacheKind, KVCacheLayout, Order, head_range

__all__ = [
    "BlockIds",
    "RankInfo",
    "RankPlan",
    "RegionTable",
    "Source",
    "TransferPlan",
    "TransferTopology",
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

    Stored factored: descriptor ``(i, j)`` is *group* ``i`` (a region and a byte offset on each
    side: one group per layer, or a single group when both caches are block-major) plus *pattern*
    entry ``j`` (offsets and length inside it), group-major. Descriptors of different layers never
    merge unless both sides are block-major, so the pattern is built and coalesced once per request
    and only the resolved arrays have the full ``groups x pattern`` size.
    """

    source: Source
    spans_per_chunk: int
    group_local_region: I64
    group_local_offset: I64
    group_remote_region: I64
    group_remote_offset: I64
    pattern_local_offset: I64
    pattern_remote_offset: I64
    pattern_length: I64

    def __post_init__(self) -> None:
        for f in fields(self)[2:]:
            object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))

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
        return self.num_layers * self.num_chunks * sum(p.spans_per_chunk for p in self.per_rank)


def parse_block_ids(spec: str) -> I64:
    """Parse ``"0:2048"``, ``"3,4,5,9"`` or ``"0:8,20:24"`` into an int64 array (ranges are half-open)."""
    parts: list[I64] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            if ":" in item:
                lo, hi = item.split(":", 1)
                parts.append(np.arange(int(lo), int(hi), dtype=np.int64))
            else:
                parts.append(np.array([int(item)], dtype=np.int64))
        except ValueError:
            raise BlockIdError(f"blocks: cannot parse {item!r} (use 'a:b' ranges or ids separated by commas)",
                               field="blocks") from None  # fmt: skip
    if not parts:
        raise BlockIdError(f"blocks: {spec!r} names no block ids", field="blocks")
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
        if kind in (CacheKind.ATTENTION, CacheKind.QUANTIZED):
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
    def plan(self, local_blocks: BlockIds, remote_blocks: BlockIds) -> TransferPlan:
        """Descriptors moving ``remote_blocks`` of the remote ranks into ``local_blocks`` here.

        Block ids are in each side's own block size; both lists must cover the same number of
        tokens. Raises :class:`BlockIdError` before any descriptor exists if a list is empty,
        has an id out of range, repeats an id, or the token counts differ.
        """
        lb = _check_blocks(local_blocks, self.local.num_blocks, "local_blocks")
        rb = _check_blocks(remote_blocks, self.remote.num_blocks, "remote_blocks")
        nl, nr = self.local.tokens_per_page, self.remote.tokens_per_page
        if lb.size * nl != rb.size * nr:
            raise BlockIdError(
                f"remote_blocks: length mismatch: {lb.size} local blocks x {nl} tokens = {lb.size * nl} tokens, "
                f"{rb.size} remote blocks x {nr} tokens = {rb.size * nr} tokens",
                field="remote_blocks",
            )
        g = self._granule
        chunks = lb.size * nl // g
        c = np.arange(chunks, dtype=np.int64)
        per_l, per_r = nl // g, nr // g
        l_block, l_tok = lb[c // per_l], (c % per_l) * g
        r_block, r_tok = rb[c // per_r], (c % per_r) * g
        plans = tuple(self._plan_source(src, l_block, l_tok, r_block, r_tok) for src in self._sources)
        return TransferPlan(plans, chunks, self.local.num_layers, self._warnings)

    @cached_property
    def _granule(self) -> int:
        """Tokens per chunk: the smaller block size (a chunk lies inside one block on each side)."""
        return min(self.local.tokens_per_page, self.remote.tokens_per_page)

    @cached_property
    def _patterns(self) -> dict[Source, tuple[I64, I64, I64]]:
        """Each source's unit pattern (see :func:`_unit_pattern`), read-only: shared by every plan."""
        out = {}
        for src in self._sources:
            lo, ro, ln = _unit_pattern(self.local, self.remote, src, self._granule)
            out[src] = (_frozen(lo), _frozen(ro), _frozen(ln))
        return out

    @cached_property
    def _warnings(self) -> tuple[str, ...]:
        loc, rem = self.local, self.remote
        out: list[str] = []
        for l_units, _, _ in self._patterns.values():
            if len(l_units) > 1 and loc.order is Order.NHD and rem.order is Order.NHD:
                out.append(
                    f"NHD with a head slice: {len(l_units)} spans per chunk per layer (one per token); HND keeps a "
                    "head slice contiguous"
                )
            elif len(l_units) > 1 and loc.order is not rem.order:
                out.append(f"local {loc.order} vs remote {rem.order}: one span per row ({len(l_units)} per chunk)")
        return tuple(dict.fromkeys(out))

    @cached_property
    def _layer_group_arrays(self) -> tuple[I64, I64, I64, I64]:
        """Region and offset of every layer's pages on each side (used when layers do not merge)."""
        layers = np.arange(self.local.num_layers, dtype=np.int64)
        lr, lo = _layer_groups(self.local, layers)
        rr, ro = _layer_groups(self.remote, layers)
        return _frozen(lr), _frozen(lo), _frozen(rr), _frozen(ro)

    def _plan_source(self, src: Source, l_block: I64, l_tok: I64, r_block: I64, r_tok: I64) -> RankPlan:
        loc, rem = self.local, self.remote
        l_units, r_units, u_len = self._patterns[src]
        spans_per_chunk = len(l_units)
        # Chunk start offsets inside each side's region, for layer 0.
        l_start = l_block * loc.block_stride + _token_offset(loc, l_tok)
        r_start = r_block * rem.block_stride + _token_offset(rem, r_tok)
        if loc.cross_layer and rem.cross_layer:
            zero = np.zeros(1, np.int64)
            lo, ro, ln = _block_major_pattern(loc, rem, l_start, r_start, l_units, r_units, u_len)
            return RankPlan(src, spans_per_chunk, zero, zero, zero, zero, lo, ro, ln)
        # At least one side has a region per layer, so layers never merge and every layer repeats
        # one pattern at its own region and offset.
        if len(l_units) == 1:
            lo, ro, ln = _merge_runs(l_start + l_units[0], r_start + r_units[0], int(u_len[0]))
        else:
            lo = (l_start[:, None] + l_units[None, :]).ravel()
            ro = (r_start[:, None] + r_units[None, :]).ravel()
            lo, ro, ln = _coalesce(lo, ro, np.tile(u_len, l_start.size))
        return RankPlan(src, spans_per_chunk, *self._layer_group_arrays, lo, ro, ln)


def _layer_groups(layout: KVCacheLayout, layers: I64) -> tuple[I64, I64]:
    """Region and offset of each layer's pages: its own region, or its slot in a block-major block."""
    if layout.cross_layer:
        return np.zeros_like(layers), layers * layout.page_bytes
    return layers, np.zeros_like(layers)


def _block_major_pattern(
    loc: KVCacheLayout, rem: KVCacheLayout, l_start: I64, r_start: I64, l_units: I64, r_units: I64, u_len: I64
) -> tuple[I64, I64, I64]:
    """Spans of every layer when both sides are block-major (one region each), merged across layers."""
    layers = np.arange(loc.num_layers, dtype=np.int64)
    if len(l_units) == 1:
        unit = int(u_len[0])
        if unit == loc.page_bytes == rem.page_bytes:
            # Whole pages on both sides: all layers of a block are one span, runs of blocks merge.
            return _merge_runs(l_start + l_units[0], r_start + r_units[0], unit * loc.num_layers)
        l_start, r_start, run_len = _merge_runs(l_start + l_units[0], r_start + r_units[0], unit)
        l_units, r_units = np.zeros(1, np.int64), np.zeros(1, np.int64)
        chunk_unit_len = run_len[:, None]
    else:
        chunk_unit_len = np.broadcast_to(u_len[None, :], (l_start.size, u_len.size))
    # (chunk, layer, unit) order puts the pages of one block's layers next to each other.
    lo = l_start[:, None, None] + (layers * loc.page_bytes)[None, :, None] + l_units[None, None, :]
    ro = r_start[:, None, None] + (layers * rem.page_bytes)[None, :, None] + r_units[None, None, :]
    ln = np.broadcast_to(chunk_unit_len[:, None, :], lo.shape)
    return _coalesce(lo.ravel(), ro.ravel(), ln.ravel())


def _token_offset(layout: KVCacheLayout, tokens: I64) -> I64:
    """Byte offset of a token inside a page, for the token-range start of each chunk."""
    if layout.order is Order.HND:
        return tokens * layout.row_bytes
    return tokens * (layout.entries * layout.row_bytes)


def _unit_pattern(loc: KVCacheLayout, rem: KVCacheLayout, src: Source, g: int) -> tuple[I64, I64, I64]:
    """Offsets (from a chunk's start) and lengths of the units of one chunk, merged where possible."""
    row = loc.row_bytes
    groups = loc.head_groups
    nh = src.num_heads
    grp = np.arange(groups, dtype=np.int64)
    heads = np.arange(nh, dtype=np.int64)
    toks = np.arange(g, dtype=np.int64)

    def entry(layout: KVCacheLayout, first: int) -> I64:
        # entry index of (group, head) in that side's page
        return (grp[:, None] * layout.num_kv_heads + first + heads[None, :]).ravel()

    le, re_ = entry(loc, src.local_head), entry(rem, src.remote_head)
    if loc.order is Order.HND and rem.order is Order.HND:
        lo = le * loc.tokens_per_page * row
        ro = re_ * rem.tokens_per_page * row
        ln = np.full(lo.size, g * row, np.int64)
    elif loc.order is Order.NHD and rem.order is Order.NHD:
        # One unit per (token, group): nh consecutive entries of one token.
        lo = (toks[:, None] * loc.entries * row + (grp * loc.num_kv_heads + src.local_head)[None, :] * row).ravel()
        ro = (toks[:, None] * rem.entries * row + (grp * rem.num_kv_heads + src.remote_head)[None, :] * row).ravel()
        ln = np.full(lo.size, nh * row, np.int64)
    else:
        lo = _row_offsets(loc, le, toks)
        ro = _row_offsets(rem, re_, toks)
        ln = np.full(lo.size, row, np.int64)
    order = np.argsort(lo, kind="stable")
    return _coalesce(lo[order], ro[order], ln[order])


def _row_offsets(layout: KVCacheLayout, entries: I64, toks: I64) -> I64:
    row = layout.row_bytes
    if layout.order is Order.HND:
        return (entries[:, None] * layout.tokens_per_page * row + toks[None, :] * row).ravel()
    return (toks[None, :] * layout.entries * row + entries[:, None] * row).ravel()


def _merge_runs(l_start: I64, r_start: I64, unit: int) -> tuple[I64, I64, I64]:
    """Merge consecutive chunks whose single unit continues on both sides; returns starts and lengths."""
    if l_start.size <= 1:
        return l_start, r_start, np.full(l_start.size, unit, np.int64)
    brk = np.ones(l_start.size, dtype=bool)
    brk[1:] = (l_start[1:] != l_start[:-1] + unit) | (r_start[1:] != r_start[:-1] + unit)
    starts = np.flatnonzero(brk)
    counts = np.diff(np.append(starts, l_start.size))
    return l_start[starts], r_start[starts], counts * unit


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


def _check_blocks(ids: BlockIds, num_blocks: int, name: str) -> I64:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise BlockIdError(f"{name}: expected a flat list of block ids, got shape {arr.shape}", field=name)
    if arr.size == 0:
        raise BlockIdError(f"{name}: empty request (no block ids)", field=name)
    if arr.dtype.kind not in "iu":
        raise BlockIdError(f"{name}: block ids must be integers, got dtype {arr.dtype}", field=name)
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() >= num_blocks:
        bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
        i = int(bad[0])
        raise BlockIdError(
            f"{name}: block id {int(arr[i])} at position {i} is out of range [0, {num_blocks})"
            + (f" ({bad.size} ids out of range)" if bad.size > 1 else ""),
            field=name,
        )
    if arr.size > 1:
        srt = np.sort(arr)
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            raise BlockIdError(f"{name}: block id {int(srt[dup[0]])} appears more than once", field=name)
    return arr


def _resolve(table: RegionTable, g_region: I64, g_offset: I64, p_offset: I64, p_length: I64, side: str) -> U64:
    """Addresses of the ``groups x pattern`` descriptors, each checked against its region's size."""
    # ndarray methods rather than the np.* wrappers, and the error details only once a check fails:
    # a pull of one block resolves a handful of descriptors, where numpy's per-call cost dominates.
    groups, per = g_region.size, p_offset.size
    n_regions = table.base.size
    if groups and g_region.max() >= n_regions:
        raise LayoutError(
            f"regions: {side} descriptors need region {int(g_region.max())}, only {n_regions} registered",
            field="regions",
        )
    out = np.empty((groups, per, 3), dtype=np.uint64)
    if groups == 0 or per == 0:
        return out.reshape(-1, 3)
    p_end = p_offset + p_length
    # One comparison per group: the furthest byte any pattern entry reaches in it.
    size = table.size.take(g_region)
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
    base = table.base.take(g_region) + g_offset.view(np.uint64)
    np.add(base[:, None], p_offset.view(np.uint64)[None, :], out=out[:, :, 0])
    out[:, :, 1] = p_length.view(np.uint64)[None, :]
    out[:, :, 2] = table.device.take(g_region)[:, None]
    return out.reshape(-1, 3)


def _frozen(a: npt.ArrayLike) -> I64:
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and not a.flags.writeable and a.flags.c_contiguous:
        return a  # already read-only (e.g. a topology's cached pattern): share it
    # A new view, so that a caller's own array keeps its flags.
    arr = np.ascontiguousarray(a, dtype=np.int64).view()
    arr.flags.writeable = False
    return arr
