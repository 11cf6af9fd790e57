"""TransferTopology: the sources of a local rank, their unit patterns, and each request's plan.

See the package's docs (:mod:`kvxfer.topology`) for the chunk and unit model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvxfer.errors import BlockIdError, IncompatibleLayoutError, LayoutError, TopologyError
from kvxfer.layout import CacheKind, KVCacheLayout, Order, Packing, head_range
from kvxfer.topology.blocks import I64, BlockIds, check_block_ids
from kvxfer.topology.plans import RankInfo, RankPlan, Source, TransferPlan, frozen

__all__ = ["TransferTopology"]


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
        if self._mamba_split:
            self._check_segments()
        elif kind is CacheKind.MAMBA and self._mamba_replicated:
            pass  # every rank holds the whole state: any TP sizes
        elif kind is CacheKind.MAMBA and self.remote_tp_size != self.local_rank.tp_size:
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

    # ------------------------------------------------------------------ mamba state
    @property
    def _mamba_split(self) -> bool:
        """Both sides split their mamba pages in TP segments: pieces of each segment move between any TP sizes."""
        return bool(self.local.segments and self.remote.segments)

    @property
    def _mamba_replicated(self) -> bool:
        return self.local.replicated and self.remote.replicated

    def _check_segments(self) -> None:
        lt, rt = self.local_rank.tp_size, self.remote_tp_size
        for i, (a, b) in enumerate(zip(self.local.segments, self.remote.segments, strict=True)):
            if a * lt != b * rt:
                raise TopologyError(
                    f"segments: segment {i} of the mamba state is {a} bytes per rank x local tp_size {lt} = {a * lt} "
                    f"bytes, but {b} bytes per rank x remote tp_size {rt} = {b * rt} bytes (local segments "
                    f"{list(self.local.segments)}, remote {list(self.remote.segments)})",
                    field="segments",
                )

    @cached_property
    def _mamba_pieces(self) -> dict[int, tuple[I64, I64, I64]]:
        """Per remote rank: (local offset, remote offset, length) inside a page of each piece it gives.

        Segment i is ``G = s_l * local_tp = s_r * remote_tp`` bytes; the local rank d holds its bytes
        ``[d * s_l, (d + 1) * s_l)``, remote rank p ``[p * s_r, (p + 1) * s_r)``: their intersection
        moves, each side's piece at the segment's offset inside its own page.
        """
        d = self.local_rank.tp_rank
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        l_base = r_base = 0
        for s_l, s_r in zip(self.local.segments, self.remote.segments, strict=True):
            lo, hi = d * s_l, (d + 1) * s_l
            for p in range(lo // s_r, -(-hi // s_r)):
                a, b = max(lo, p * s_r), min(hi, (p + 1) * s_r)
                pieces.setdefault(p, []).append((l_base + a - lo, r_base + a - p * s_r, b - a))
            l_base, r_base = l_base + s_l, r_base + s_r
        out = {}
        for p, units in sorted(pieces.items()):
            arr = np.array(units, dtype=np.int64).reshape(-1, 3)
            out[p] = (arr[:, 0], arr[:, 1], arr[:, 2])
        return out

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
        if self._mamba_split:
            lt, rt, n = local_tp, self.remote_tp_size, len(self.local.segments)
            return tuple(
                Source(p, 0, 0, 1, 0, f"mamba state in {n} segments, each split evenly over TP: remote rank {p} "
                                      f"holds slice {p} of {rt} of each, local rank {rank} needs slice {rank} of {lt}")
                for p in self._mamba_pieces
            )  # fmt: skip
        if self._mamba_replicated:
            r = rank % self.remote_tp_size
            return (Source(r, 0, 0, 1, 0, f"mamba state is replicated on every rank: read it from remote rank {r}"),)
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
        if self._mamba_split:  # one page per block (block_size 1): its pieces from this source
            lo, ro, ln = self._mamba_pieces[src.remote_rank]
        else:
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
        return frozen(lr), frozen(lo), frozen(rr), frozen(ro)

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
        local, remote, length = (frozen(a) for a in arrays)
        return cls(local, remote, length, frozen(count), frozen(np.array(layer_units, np.int64)))

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
