"""kvxfer.harness.landing.BatchLanding: the load bench's batched byte checks find exactly the bytes that differ."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.harness.cluster import BlockAllocator
from kvxfer.harness.landing import BatchLanding

BLOCKS, PAGE, LAYERS, PER_PULL = 64, 256, 3, 2


def _setup() -> tuple[list[np.ndarray], list[np.ndarray], BlockAllocator]:
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
    want = [rng.integers(0, 256, (PER_PULL, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
    return pages, want, BlockAllocator(BLOCKS, rng, max_run=PER_PULL)


def test_free_blocks_start_poisoned_and_a_pull_that_moved_nothing_fails_every_byte() -> None:
    pages, want, alloc = _setup()
    landing = BatchLanding(pages, want, alloc)
    for layer in range(LAYERS):  # every free block holds the poison, which differs from each source page
        assert (pages[layer] == landing.poison[layer]).all()
        assert (want[layer] != landing.poison[layer]).any(axis=1).all()
    moved, nothing, half, failed = (alloc.allocate(PER_PULL) for _ in range(4))
    for layer in range(LAYERS):
        pages[layer][moved] = want[layer]
        pages[layer][half] = want[layer]
        pages[layer][half[1], : PAGE // 2] ^= 0x0F  # 128 bytes of one page differ
        pages[layer][failed] = 0
    rows: list[dict[str, float]] = [{"bad": -1} for _ in range(3)]
    for blocks, row in zip((moved, nothing, half, failed), (*rows, None), strict=True):
        landing.add(blocks, row)
    assert alloc.free == BLOCKS - 4 * PER_PULL  # not released before they are checked
    assert landing.check() == 3
    poison_bytes = sum(int((w != p).sum()) for w, p in zip(want, landing.poison, strict=True))
    assert [r["bad"] for r in rows] == [0, poison_bytes, LAYERS * PAGE // 2]
    assert (landing.checked, landing.mismatched) == (3, poison_bytes + LAYERS * PAGE // 2)
    # Checked or failed, every block is free again and poisoned for the next pull.
    assert alloc.free == BLOCKS
    for layer in range(LAYERS):
        assert (pages[layer] == landing.poison[layer]).all()
    assert landing.check() == 0


def test_a_source_page_equal_to_the_poison_is_refused() -> None:
    pages, want, alloc = _setup()
    want[1][1] = np.bitwise_not(want[1][0])
    with pytest.raises(ValueError, match="want: source page 1 of layer 1 equals the poison"):
        BatchLanding(pages, want, alloc)
    with pytest.raises(ValueError, match="want: 2 layers of source pages for 3 layers"):
        BatchLanding(pages, want[:2], alloc)
