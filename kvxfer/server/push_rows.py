"""An offer's rows: the reader's pull plan restricted to this rank, as (this side's, the reader's)
descriptor arrays to WRITE. What :class:`~kvxfer.topology.PushTopology` does for every receiver,
done here for one reader rank: the whole offer once its request is published
(:class:`~kvxfer.server.pusher.Pusher`), or one layer's tokens as a stream step announces them
(:class:`~kvxfer.server.streamer.Streamer`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidArgumentError, KvxferError
from kvxfer.server.state import Offer, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import not_published

__all__ = ["NO_ROWS", "group_rows", "offer_rows", "token_span"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: No rows: this rank holds nothing of the reader's plan (or every group was skipped).
NO_ROWS: U64 = np.zeros((0, 3), np.uint64)


def offer_rows(
    topologies: TopologyCache, offer: Offer, reg: Registration, published: dict[str, I64], origins: dict[str, int],
    skip: set[str] | None = None,
) -> tuple[U64, U64]:  # fmt: skip
    """(this side's, the reader's) descriptor arrays of every group but ``skip``, for the whole offer."""
    mine, theirs = [], []
    for name, g in reg.groups.items():
        if skip and name in skip:
            continue
        ids = offer.writer_given.get(name)
        if ids is not None and not_published(ids, published[name]):
            raise InvalidArgumentError(f"writer_blocks[{name}]: {not_published(ids, published[name])}",
                                       field=f"writer_blocks[{name}]")  # fmt: skip
        num_tokens, reader_skip, writer_skip = offer.spans.get(name, (None, 0, 0))
        if ids is None and num_tokens is not None:
            ids, writer_skip = token_span(name, published[name], g.layout.block_size, origins.get(name, 0),
                                          writer_skip, num_tokens, "writer_blocks")  # fmt: skip
        elif ids is None:
            ids = published[name]
        try:
            rows = group_rows(topologies, offer, reg, name, offer.blocks[name], ids, num_tokens=num_tokens,
                              reader_skip=reader_skip, writer_skip=writer_skip)  # fmt: skip
        except KvxferError as exc:
            field = exc.field or "blocks"
            raise InvalidArgumentError(f"{field}[{name}]: {exc.message.split(': ', 1)[-1]}",
                                       field=f"{field}[{name}]") from None  # fmt: skip
        mine.append(rows[0])
        theirs.append(rows[1])
    if not mine:
        return NO_ROWS, NO_ROWS
    return np.concatenate(mine), np.concatenate(theirs)


def group_rows(
    topologies: TopologyCache, offer: Offer, reg: Registration, group: str, reader_ids: I64, writer_ids: I64, *,
    num_tokens: int | None, reader_skip: int, writer_skip: int,
) -> tuple[U64, U64, I64]:  # fmt: skip
    """The reader's pull plan of ``group`` restricted to this rank: (this side's rows, the reader's rows,
    this side's region of each row). Raises the topology's error for lists that do not fit."""
    g = reg.groups[group]
    topo = topologies.topology(f"<{group}", offer.reader.groups[group], g.layout, offer.rank,
                               reg.rank.tp_size)  # fmt: skip
    plan = topo.plan(reader_ids, writer_ids, num_tokens=num_tokens, local_skip=reader_skip,
                     remote_skip=writer_skip)  # fmt: skip
    mine, theirs, regions = [], [], []
    for rp in plan.per_rank:
        if rp.remote_rank == reg.rank.tp_rank:
            into, out_of = rp.descriptors(offer.reader.regions[group][0], g.memory.table)
            mine.append(out_of)
            theirs.append(into)
            regions.append(rp.remote_region)
    if not mine:
        return NO_ROWS, NO_ROWS, np.zeros(0, np.int64)
    return np.concatenate(mine), np.concatenate(theirs), np.concatenate(regions)


def token_span(
    name: str, ids: I64, block_size: int, origin: int, at: int, num_tokens: int, field: str
) -> tuple[I64, int]:
    """The blocks of ``ids`` holding tokens ``[at, at + num_tokens)`` of the request, and the skip into the first.

    ``ids`` hold the request's tokens from position ``origin`` on. An offer names where its tokens
    start as a position in the request (the writer's block size is not the reader's business).
    """
    if at < origin:
        raise InvalidArgumentError(
            f"{field}[{name}].skip_tokens: the move starts at token {at}; the blocks hold tokens from {origin}",
            field=f"{field}[{name}].skip_tokens",
        )
    first = (at - origin) // block_size
    last = -(-(at - origin + num_tokens) // block_size)
    if last > ids.size:
        raise InvalidArgumentError(
            f"{field}[{name}]: tokens up to {at + num_tokens} are needed; {ids.size} blocks of {block_size} tokens "
            f"from token {origin} hold fewer",
            field=f"{field}[{name}]",
        )
    return ids[first:last], (at - origin) - first * block_size
