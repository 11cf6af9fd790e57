"""The bytes of a head and token range of one block: row pieces as numpy arrays
(:meth:`KVCacheLayout.row_offsets`, for planning many blocks at once) and merged byte spans
(:meth:`KVCacheLayout.spans`, one block), both read off the layout's planes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError

if TYPE_CHECKING:
    # Annotations only: the layout imports this module to answer row_offsets and spans.
    from kvxfer.layout.model import KVCacheLayout

__all__ = ["I64", "row_offsets_of", "spans_of"]

I64 = npt.NDArray[np.int64]


def row_offsets_of(layout: KVCacheLayout, heads: I64, tokens: I64) -> tuple[I64, I64]:
    """:meth:`KVCacheLayout.row_offsets`: offsets from a block's start and lengths, no checks."""
    nk = layout.tokens_per_kernel_block
    h = np.asarray(heads, dtype=np.int64)[:, None, None]
    t = np.asarray(tokens, dtype=np.int64)[None, :, None]
    offs, lens = [], []
    for p in layout.planes:
        e = np.arange(p.elements, dtype=np.int64)[None, None, :] * p.element_stride
        off = p.offset + h * p.head_stride + (t // nk) * p.kernel_stride + (t % nk) * p.token_stride + e
        offs.append(off.ravel())
        lens.append(np.full(off.size, p.row_bytes, dtype=np.int64))
    return np.concatenate(offs), np.concatenate(lens)


def spans_of(
    layout: KVCacheLayout,
    layer: int,
    block: int,
    heads: tuple[int, int] | None = None,
    tokens: tuple[int, int] | None = None,
) -> list[tuple[int, int]]:
    """:meth:`KVCacheLayout.spans`: the merged byte spans of ``heads`` x ``tokens`` of one block (ranges checked)."""
    base = layout.block_offset(layer, block)
    h0, h1 = heads if heads is not None else (0, layout.num_kv_heads)
    t0, t1 = tokens if tokens is not None else (0, layout.tokens_per_page)
    if not 0 <= h0 < h1 <= layout.num_kv_heads:
        raise LayoutError(f"heads: {heads} is not a range inside [0, {layout.num_kv_heads})", field="heads")
    if not 0 <= t0 < t1 <= layout.tokens_per_page:
        raise LayoutError(f"tokens: {tokens} is not a range inside [0, {layout.tokens_per_page})", field="tokens")
    pieces = sorted(_pieces(layout, h0, h1, t0, t1))
    merged: list[tuple[int, int]] = []
    for o, n in pieces:
        if merged and merged[-1][0] + merged[-1][1] == o:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((o, n))
    return [(base + o, n) for o, n in merged]


def _pieces(layout: KVCacheLayout, h0: int, h1: int, t0: int, t1: int) -> list[tuple[int, int]]:
    """(offset, length) of the rows of heads [h0, h1) x tokens [t0, t1), in plain Python (one block)."""
    nk = layout.tokens_per_kernel_block
    out: list[tuple[int, int]] = []
    for p in layout.planes:
        # Runs of tokens inside one kernel block whose rows follow each other are one piece.
        contiguous = p.elements == 1 and p.token_stride == p.row_bytes
        for h in range(h0, h1):
            head = p.offset + h * p.head_stride
            t = t0
            while t < t1:
                k, tk = divmod(t, nk)
                run = min(t1 - t, nk - tk) if contiguous else 1
                start = head + k * p.kernel_stride + tk * p.token_stride
                for e in range(p.elements):
                    out.append((start + e * p.element_stride, run * p.row_bytes))
                t += run
    return out
