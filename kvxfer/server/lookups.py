"""A pull's handshakes and lookups: asking each publisher for the published request, and checking its answer.

:meth:`Lookups.fetch_all` handshakes each source rank (cached, :mod:`kvxfer.server.peers`), checks it
is the rank and engine the worker named, and asks it for the request (``GetPublished``, through
:mod:`kvxfer.server.outbox`, which batches lookups to one publisher); a publisher that restarted or
registered again since the handshake is handshaken once more. Its answer is checked like a
worker's input: block ids in range, regions those of its handshake. :func:`from_grant` and
:func:`from_handshakes` build what a lookup would answer from a grant or a handshake, for the pulls
that read without waiting for one (:mod:`kvxfer.server.pull_steps`).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, PeerUnavailableError, Reason
from kvxfer.layout import KVCacheLayout
from kvxfer.server.outbox import Outbox
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.registration import Registry
from kvxfer.server.state import Grant, PullEntry, Registration
from kvxfer.topology import RegionTable
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import check_block_ids, ids_array, rank_to_proto, regions_from_proto

__all__ = ["Fetched", "Lookups", "from_grant", "from_handshakes"]

I64 = npt.NDArray[np.int64]


@dataclass
class Fetched:
    """What one remote rank answered for a pull: per group, block ids and region table."""

    blocks: dict[str, I64]
    tables: dict[str, RegionTable]
    mem_type: str
    #: time.monotonic() until which the publisher holds the blocks for this reader (inf: not said).
    valid_until: float = math.inf


class Lookups:
    """Handshakes and lookups of the publishers a pull reads from (see the module docs)."""

    def __init__(self, registry: Registry, peers: PeerDirectory, outbox: Outbox) -> None:
        self.registry = registry
        self.peers = peers
        self.outbox = outbox

    async def fetch_all(
        self, entry: PullEntry, ranks: list[int], sessions: dict[int, PeerSession], *, stage: bool = True
    ) -> dict[int, Fetched]:
        """Handshake and look up every rank in ``ranks`` (at once): their answers by rank.

        ``sessions`` collects each rank's session as it is contacted (the pull's cleanup reads it);
        ``stage``: whether to record the step in ``entry.stage`` (not while READs run beside it).
        """
        if stage:
            entry.stage = "contacting " + ", ".join(entry.addresses[q] for q in ranks)
        if len(ranks) == 1:  # the common case: no task per rank
            fetched = [await self._fetch(entry, ranks[0], sessions)]
        else:
            fetched = await asyncio.gather(*(self._fetch(entry, q, sessions) for q in ranks))
        return dict(zip(ranks, fetched, strict=True))

    async def _fetch(self, entry: PullEntry, q: int, sessions: dict[int, PeerSession]) -> Fetched:
        """Handshake rank ``q`` (cached) and get the published request from it."""
        address = entry.addresses[q]
        for attempt in range(2):
            remaining = max(entry.deadline - time.monotonic(), 0.001)
            session = await self.peers.session(address, budget=remaining)
            try:
                self.check_rank(entry, q, session)
            except FailedPreconditionError:
                if attempt == 0 and session.identity.epoch:
                    # The handshake may predate the peer's re-registration (another TP size): ask again.
                    self.peers.invalidate(address)
                    continue
                raise
            sessions[q] = session
            if address not in entry.asked:
                entry.asked.append(address)  # an abort from here on must reach it, answered or not
            try:
                asked = time.monotonic()
                resp = await self.outbox.lookup(address, self._request(entry), entry.deadline)
            except NotFoundError:
                raise NotFoundError(
                    f"request_id: {entry.request_id!r} is not published on {session.identity.label} at {address} "
                    "(unknown, already released, or its lease expired)",
                    field="request_id",
                ) from None
            except FailedPreconditionError as exc:
                if attempt == 0 and exc.reason is Reason.NOT_HANDSHAKEN:
                    self.peers.invalidate(address)  # the peer restarted and forgot us, or we re-registered
                    continue
                raise
            them = session.identity
            if resp.instance_id != them.instance_id or resp.epoch != them.epoch:
                # The peer restarted or re-registered its memory: its data-plane metadata changed.
                self.peers.invalidate(address)
                if attempt == 0:
                    continue
                raise PeerUnavailableError(f"peer {address} changed while being contacted", field="remote_addresses",
                                           reason=Reason.PEER_CHANGED)  # fmt: skip
            if address not in entry.contacted:
                entry.contacted.append(address)
            fetched = self._answer(session, resp)
            if resp.held_seconds > 0:
                # The READs that follow must end while the publisher holds the blocks: its own
                # --transfer-timeout-seconds may be shorter than this pull's deadline.
                fetched.valid_until = asked + resp.held_seconds
                entry.deadline = min(entry.deadline, fetched.valid_until)
            return fetched
        raise PeerUnavailableError(f"peer {address}: could not get a stable handshake", field="remote_addresses",
                                   reason=Reason.PEER_CHANGED)  # fmt: skip

    def _request(self, entry: PullEntry) -> peer_pb2.GetPublishedRequest:
        me = self.registry.identity()
        return peer_pb2.GetPublishedRequest(
            request_id=entry.request_id, engine_id=me.engine_id, instance_id=me.instance_id, epoch=me.epoch,
            rank=rank_to_proto(me.rank),
        )  # fmt: skip

    @staticmethod
    def check_rank(entry: PullEntry, q: int, session: PeerSession) -> None:
        """Refuse a session that is not remote rank ``q`` of the TP size, or engine, the worker named."""
        them = session.identity
        problems = []
        if them.rank.tp_rank != q or them.rank.tp_size != len(entry.addresses):
            problems.append(
                f"it is tp rank {them.rank.tp_rank}/{them.rank.tp_size}, but remote_addresses[{q}] must be rank "
                f"{q}/{len(entry.addresses)}"
            )
        if entry.remote_engine_id and them.engine_id != entry.remote_engine_id:
            problems.append(f"it is engine {them.engine_id!r}, not {entry.remote_engine_id!r}")
        if problems:
            raise FailedPreconditionError(
                f"remote_addresses[{q}]: the sidecar at {session.address} does not match: " + "; ".join(problems),
                field=f"remote_addresses[{q}]", reason=Reason.PEER_MISMATCH,
            )  # fmt: skip

    def _answer(self, session: PeerSession, resp: peer_pb2.GetPublishedResponse) -> Fetched:
        """A publisher's answer, checked like a worker's input: READs may only touch what its handshake announced."""
        out = Fetched({}, {}, "DRAM")
        address = session.address
        for pg in resp.groups:
            layout = session.identity.groups.get(pg.name)
            if layout is None:
                raise PeerUnavailableError(f"peer {address} published unknown group {pg.name!r}", field="groups",
                                           reason=Reason.PEER_INPUT)  # fmt: skip
            try:
                out.blocks[pg.name] = check_block_ids(
                    ids_array(pg.block_ids), layout.num_blocks,
                    f"peer {address} published block_ids[{pg.name}]",
                )  # fmt: skip
                out.tables[pg.name], out.mem_type = _remote_regions(session, pg, layout)
            except InvalidArgumentError as exc:
                raise FailedPreconditionError(f"{exc.message}; refusing to read", field="remote_addresses",
                                              reason=Reason.PEER_INPUT) from None  # fmt: skip
        return out


def from_grant(grant: Grant, session: PeerSession, reg: Registration) -> Fetched:
    """What a lookup would answer, from a publisher's grant and its handshake's regions."""
    first = next(iter(reg.groups))
    regions = session.identity.regions
    return Fetched(dict(grant.blocks), {n: regions[n][0] for n in reg.groups}, regions[first][1])


def from_handshakes(
    used: dict[int, PeerSession], remote_given: dict[str, I64], reg: Registration
) -> dict[int, Fetched]:
    """What a lookup would answer, from the worker's ids and each publisher's handshake (its regions)."""
    first = next(iter(reg.groups))
    return {
        q: Fetched(dict(remote_given), {n: s.identity.regions[n][0] for n in reg.groups}, s.identity.regions[first][1])
        for q, s in used.items()
    }


def _remote_regions(
    session: PeerSession, pg: peer_pb2.PublishedGroup, layout: KVCacheLayout
) -> tuple[RegionTable, str]:
    """A publisher's region table and memory type, parsed and checked at its first answer in a session, then reused.

    A session is one instance and epoch of the peer (an answer from another is refused before
    this), and a registration's regions and memory are fixed: a later answer that names other ones
    is not believed, and the READs that follow a lookup use what was checked first (those on a
    grant or ahead of the lookup use the handshake's). Building the tuple to compare them cost
    every pull ~6 us per layer.
    """
    known = session.regions.get(pg.name)
    if known is None:
        table = regions_from_proto(pg.regions, layout, f"peer {session.address} regions[{pg.name}]")
        # normalized as the handshake's are (kvxfer.server.identity): anything but VRAM is host memory
        known = session.regions[pg.name] = (table, "VRAM" if pg.memory_type == "VRAM" else "DRAM")
    return known
