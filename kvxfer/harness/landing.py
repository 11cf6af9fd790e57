"""Checking pulled pages in batches, off each pull's path (the load bench's open loop).

A worker does not read its blocks back after a pull; the driver that plays one in a benchmark
does, every byte, and poisons the blocks before they are pulled into, so that a pull that moved
nothing cannot pass. Done per pull, in the event loop that also reads every other pull's answer,
that work queues the answers behind it. :class:`BatchLanding` does it for all the pulls that
landed since its last check at once (vectorized over them) and hands their blocks back to the
allocator poisoned for the next pull.

The poison of a layer is one page, written into every block the allocator may hand out before
the phase starts and after each check: the bitwise inverse of the first source page, checked to
differ somewhere from every source page of a pull (so a page that kept it cannot pass for any of
them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.harness.cluster import BlockAllocator

__all__ = ["BatchLanding"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


class BatchLanding:
    """Pulls' blocks to check together: every pull reads the same source pages ``want`` (one array per layer).

    ``pages``: the destination's ``(num_blocks, page_bytes)`` view per layer; ``want``: the
    ``(blocks per pull, page_bytes)`` source pages per layer, which every landed pull must hold.
    """

    def __init__(self, pages: Sequence[U8], want: Sequence[U8], alloc: BlockAllocator) -> None:
        if len(pages) != len(want):
            raise ValueError(f"want: {len(want)} layers of source pages for {len(pages)} layers of destination")
        self.pages = list(pages)
        self.want = list(want)
        self.alloc = alloc
        self.poison = [np.bitwise_not(w[0]) for w in self.want]
        for layer, (w, p) in enumerate(zip(self.want, self.poison, strict=True)):
            same = np.flatnonzero(~(w != p).any(axis=1))
            if same.size:  # a pull that moved nothing would pass for that source page
                raise ValueError(f"want: source page {int(same[0])} of layer {layer} equals the poison")
        #: Blocks of pulls not checked yet, and each one's row (None: the pull failed, only re-poisoned).
        self.pending: list[tuple[I64, dict[str, float] | None]] = []
        #: Pulls checked so far, and their bytes that differed from the source.
        self.checked = 0
        self.mismatched = 0
        self._poison(alloc.free_ids())

    def add(self, blocks: I64, row: dict[str, float] | None) -> None:
        """A pull into ``blocks`` ended: ``row`` gets its ``bad`` bytes at the next :meth:`check` (None: failed)."""
        self.pending.append((blocks, row))

    def check(self) -> int:
        """Check every pending pull, poison and release their blocks; returns how many pulls were checked."""
        pending, self.pending = self.pending, []
        if not pending:
            return 0
        landed = [(b, row) for b, row in pending if row is not None]
        if landed:
            ids = np.concatenate([b for b, _ in landed])
            bad = np.zeros(len(landed), dtype=np.int64)
            for pages, w in zip(self.pages, self.want, strict=True):
                got = pages[ids].reshape(len(landed), *w.shape)
                bad += (got != w[None]).reshape(len(landed), -1).sum(axis=1)
            for (_, row), b in zip(landed, bad.tolist(), strict=True):
                assert row is not None
                row["bad"] = b
            self.checked += len(landed)
            self.mismatched += int(bad.sum())
        ids = np.concatenate([b for b, _ in pending])
        self._poison(ids)
        self.alloc.release(ids)
        return len(landed)

    def _poison(self, ids: I64) -> None:
        for pages, p in zip(self.pages, self.poison, strict=True):
            pages[ids] = p
