"""Step 3 of a pull (:mod:`kvxfer.server.pull_steps`): the block ids checked, every rank's descriptors built.

:func:`remote_lists` checks the worker's remote ids against what each source rank published (a reader
may take any part of a publish, nothing beyond it) and groups the ranks that published the same list;
:func:`descriptors` plans each group with :mod:`kvxfer.topology` (cached per registration:
:mod:`kvxfer.server.topologies`) and turns the plan into each remote rank's (local, remote) descriptor
arrays, against the regions its handshake or lookup gave. Bad ids raise ``INVALID_ARGUMENT`` naming
the field and group.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidArgumentError, KvxferError
from kvxfer.server.lookups import Fetched
from kvxfer.server.peers import PeerSession
from kvxfer.server.state import PullEntry, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import not_published

__all__ = ["descriptors", "remote_lists"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def descriptors(
    topologies: TopologyCache, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64],
    remote_given: dict[str, I64], published: dict[int, Fetched], sessions: dict[int, PeerSession],
) -> tuple[dict[int, list[tuple[U64, U64]]], list[str]]:  # fmt: skip
    """Validate block ids and build every rank's descriptor arrays, group by group."""
    entry.stage = "building descriptors"
    remote_tp = len(entry.addresses)
    per_rank: dict[int, list[tuple[U64, U64]]] = {q: [] for q in published}
    warnings: list[str] = []
    for name, g in reg.groups.items():
        for rids, qs in remote_lists(entry, name, remote_given.get(name), published):
            topo = topologies.topology(name, g.layout, sessions[qs[0]].identity.groups[name], reg.rank,
                                       remote_tp)  # fmt: skip
            num_tokens, local_skip, remote_skip = entry.spans.get(name, (None, 0, 0))
            try:
                plan = topo.plan(local_blocks[name], rids, num_tokens=num_tokens, local_skip=local_skip,
                                 remote_skip=remote_skip)  # fmt: skip
            except KvxferError as exc:
                field = exc.field or "blocks"
                raise InvalidArgumentError(f"{field}[{name}]: {exc.message.split(': ', 1)[-1]}",
                                           field=f"{field}[{name}]") from None  # fmt: skip
            warnings.extend(plan.warnings)
            for rp in plan.per_rank:
                if rp.remote_rank in qs:
                    per_rank[rp.remote_rank].append(
                        rp.descriptors(g.memory.table, published[rp.remote_rank].tables[name])
                    )
    return per_rank, warnings


def remote_lists(
    entry: PullEntry, name: str, given: I64 | None, published: dict[int, Fetched]
) -> list[tuple[I64, list[int]]]:
    """The remote ids to read per distinct published list, and which ranks published it."""
    by_list: dict[bytes, list[int]] = {}
    chosen: dict[bytes, I64] = {}
    for q, fetched in published.items():
        rids = fetched.blocks[name]
        if given is not None:
            # A reader may take any part of a publish (e.g. the tail its own prefix cache lacks), but
            # nothing beyond it: ids that were not published are refused before any descriptor exists.
            unknown = not_published(given, rids)
            if unknown:
                raise InvalidArgumentError(
                    f"remote_blocks[{name}]: {unknown} (remote rank {q} at {entry.addresses[q]} published "
                    f"{rids.size} blocks)",
                    field=f"remote_blocks[{name}]",
                )
        key = rids.tobytes()
        by_list.setdefault(key, []).append(q)
        chosen[key] = given if given is not None else rids
    return [(chosen[k], qs) for k, qs in by_list.items()]
