"""Block-id lists: the checks every plan makes before any descriptor exists, and the CLI's parser."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import BlockIdError

__all__ = ["I64", "MAX_PARSED_IDS", "BlockIds", "check_block_ids", "parse_block_ids"]

I64 = npt.NDArray[np.int64]
BlockIds = Sequence[int] | npt.NDArray[np.integer]


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
