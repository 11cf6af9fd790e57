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
  of an nvfp4 head slice, one row when the two sides order heads and tokens differently, or the
  intersection of the local and a remote rank's slices of one segment of a Mamba state split in
  TP segments).

Units are computed once per topology from the layouts' planes (:attr:`KVCacheLayout.planes`)
for each *phase* (which slice of the larger block a chunk is, when block sizes differ); runs of
chunks whose single unit continues on both sides are merged on the block lists alone, and
otherwise the units of every chunk are sorted and merged wherever they are adjacent on both
sides (e.g. every layer of a block-major block, or a head's run of blocks when heads lie outside
the block

Reading path: :mod:`.blocks` (block-id lists: checks and parsing), :mod:`.plans` (what a plan is:
ranks, region tables, per-rank descriptors and their resolution to addresses), :mod:`.transfer`
(:class:`TransferTopology`: sources, unit patterns, coalescing), :mod:`.push` (the WRITE side's
plans, from the readers' ones). Part of the pure core: frozen dataclasses, numpy only, no I/O.
"""

from kvxfer.topology.blocks import MAX_PARSED_IDS, BlockIds, check_block_ids, parse_block_ids
from kvxfer.topology.plans import PushPlan, RankInfo, RankPlan, RegionIndex, RegionTable, Source, TransferPlan
from kvxfer.topology.push import PushTopology
from kvxfer.topology.transfer import TransferTopology

__all__ = [
    "MAX_PARSED_IDS",
    "BlockIds",
    "PushPlan",
    "PushTopology",
    "RankInfo",
    "RankPlan",
    "RegionIndex",
    "RegionTable",
    "Source",
    "TransferPlan",
    "TransferTopology",
    "check_block_ids",
    "parse_block_ids",
]
