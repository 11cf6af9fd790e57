"""RegionIndex: the region a byte span lies in, against a search over every region."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.topology import RegionIndex


@st.composite
def regions_and_spans(draw: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Regions that may share a base, nest or overlap (one allocation's groups), and spans near them."""
    regions: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(0, 6))):
        if regions and draw(st.booleans()):
            base = draw(st.sampled_from(regions))[0] + draw(st.sampled_from([0, 0, 64, 4096]))
        else:
            base = draw(st.integers(0, 1 << 20))
        regions.append((base, draw(st.integers(1, 1 << 16))))
    spans = []
    for _ in range(draw(st.integers(1, 10))):
        if regions and draw(st.booleans()):
            base, size = draw(st.sampled_from(regions))
            start = draw(st.integers(max(base - 8, 0), base + size))
        else:
            start = draw(st.integers(0, 1 << 21))
        spans.append((start, draw(st.one_of(st.integers(1, 1 << 17), st.just((1 << 64) - 1)))))
    return regions, spans


@given(regions_and_spans())
@settings(max_examples=500, deadline=None)
def test_a_span_is_found_exactly_when_some_region_holds_it(case: Any) -> None:
    regions, spans = case
    index = RegionIndex.of([b for b, _ in regions], [s for _, s in regions])
    region, inside = index.find(np.array([a for a, _ in spans], np.uint64), np.array([z for _, z in spans], np.uint64))
    for k, (addr, size) in enumerate(spans):
        holders = [i for i, (b, s) in enumerate(regions) if b <= addr and addr + size <= b + s]
        assert bool(inside[k]) == bool(holders), (addr, size)
        if holders:
            assert int(region[k]) in holders


def test_the_longer_of_two_regions_at_one_base_holds_the_tail() -> None:
    # Block-major groups of one allocation: two layers' pages per block, then one padded Mamba page.
    base, block = 1 << 32, 16384
    index = RegionIndex.of([base, base], [8 * block, 7 * block + 8192])
    region, inside = index.find(np.array([base + 7 * block], np.uint64), np.array([block], np.uint64))
    assert (region.tolist(), inside.tolist()) == ([0], [True])
    region, inside = index.find(np.array([base + 8 * block - 1], np.uint64), np.array([2], np.uint64))
    assert inside.tolist() == [False]
