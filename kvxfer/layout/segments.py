"""A mamba page's TP split (:attr:`KVCacheLayout.segments`, :attr:`KVCacheLayout.replicated`): the
segments' checks, what two mamba layouts must share to exchange pages, and the page another TP size
holds (:meth:`KVCacheLayout.resharded`). See :mod:`kvxfer.layout` for what a segment is."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvxfer.errors import LayoutError
from kvxfer.layout.kinds import CacheKind

if TYPE_CHECKING:
    # Annotations only: the layout imports this module to check and reshard its segments.
    from kvxfer.layout.model import KVCacheLayout

__all__ = ["MAX_SEGMENTS", "check_segments", "normalized_segments", "reshard", "segment_incompatibilities"]

#: Segments one mamba page may be split in (vLLM's have at most four: x, B, C and the SSM state).
MAX_SEGMENTS = 16


def normalized_segments(segments: object) -> tuple[int, ...]:
    """``segments`` as the layout keeps them (a tuple of ints), after checking each is a byte size."""
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise LayoutError(f"segments: must be a sequence of byte sizes, got {segments!r}", field="segments")
    for value in segments:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"segments: every size must be a positive integer, got {list(segments)!r}",
                              field="segments")  # fmt: skip
    if len(segments) > MAX_SEGMENTS:
        raise LayoutError(f"segments: {len(segments)} segments, at most {MAX_SEGMENTS}", field="segments")
    return tuple(int(v) for v in segments)


def check_segments(layout: KVCacheLayout) -> None:
    """Raise :class:`LayoutError` when ``segments`` / ``replicated`` do not fit the layout's kind and page."""
    if layout.kind is not CacheKind.MAMBA:
        if layout.segments:
            raise LayoutError(f"segments: only a mamba page is split into TP segments, not a {layout.kind} cache",
                              field="segments")  # fmt: skip
        if layout.replicated:
            raise LayoutError(f"replicated: only a mamba page carries this flag, not a {layout.kind} cache",
                              field="replicated")  # fmt: skip
        return
    if layout.segments and layout.replicated:
        raise LayoutError(
            f"segments: a replicated mamba page (replicated=True) is not split over TP ranks, got segments "
            f"{list(layout.segments)}",
            field="segments",
        )
    if layout.segments and sum(layout.segments) != layout.head_size:
        raise LayoutError(
            f"segments: {list(layout.segments)} sum to {sum(layout.segments)} bytes, the mamba page holds "
            f"page_size_bytes={layout.head_size}",
            field="segments",
        )


def segment_incompatibilities(local: KVCacheLayout, remote: KVCacheLayout) -> list[str]:
    """Two mamba pages of which at least one is split into TP segments (page sizes then differ by TP size)."""
    if local.segments and remote.segments:
        if len(local.segments) == len(remote.segments):
            return []  # the global sizes need both TP sizes: TransferTopology checks them
        return [
            f"segments: local {len(local.segments)} segments {list(local.segments)}, remote "
            f"{len(remote.segments)} segments {list(remote.segments)} (the mamba states are split differently)"
        ]
    if local.replicated or remote.replicated:
        return [
            f"replicated: local {local.replicated}, remote {remote.replicated} (one side holds the whole mamba state "
            "on every rank, the other splits it in segments)"
        ]
    # One side opaque: whole pages, which must be the same size (and the TP sizes equal).
    if local.head_size != remote.head_size:
        side = "remote" if local.segments else "local"
        return [
            f"page_size_bytes: local {local.head_size}, remote {remote.head_size} (the {side} page has no TP "
            "segments: it moves whole, between equal TP sizes only)"
        ]
    return []


def reshard(layout: KVCacheLayout, tp_size: int, new_tp_size: int) -> KVCacheLayout:
    """:meth:`KVCacheLayout.resharded`: ``layout`` with each segment scaled from ``tp_size`` to ``new_tp_size``."""
    if not layout.segments or tp_size == new_tp_size:
        return layout
    out = []
    for i, size in enumerate(layout.segments):
        total = size * tp_size
        if total % new_tp_size:
            raise LayoutError(
                f"segments: segment {i} of the mamba state is {total} bytes ({size} per rank x tp_size "
                f"{tp_size}), which does not split evenly over tp_size {new_tp_size}",
                field="segments",
            )
        out.append(total // new_tp_size)
    return dataclasses.replace(layout, head_size=sum(out), segments=tuple(out), page_stride=0, block_bytes=0)
