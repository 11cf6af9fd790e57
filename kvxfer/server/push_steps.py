"""The reader's side of push mode: offer the blocks to every source rank, wait until all landed.

A pull with ``push`` set does not READ. Its sources are worked out as for a pull
(:meth:`PullSteps._plan_sources <kvxfer.server.pull_steps.PullSteps>`); each is handshaken (which
hands it this rank's layouts, regions and data-plane metadata, after the peer authenticated) and
sent an ``Offer``: the request id, this rank's blocks and the time left. Each source WRITEs its
part once the request is published there and calls this sidecar's ``Landed``
(:meth:`kvxfer.server.puller.Puller.landed` routes it here); the pull is done when every source
landed.

**The fence.** A pull that ends any other way (a failed Landed, its deadline, an abort, the
worker gone) first takes back every offer that has not landed (``Revoke``) and waits for the
answers: a writer answers once no WRITE of the offer is in flight and none will start. Only then
is the outcome reported, so the worker never reuses a block a late WRITE could still land in. A
writer that cannot be reached lapses its offer at the deadline it was given; the fence then waits
until that deadline has passed on this side's clock (plus a margin) before it reports. A writer
answers a ``Revoke`` once the WRITE it cancelled was fenced, so the call waits the fence budget
beyond its cap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError, Reason
from kvxfer.logs import get_logger
from kvxfer.server.identity import Identity
from kvxfer.server.outbox import PEER_CALL_SECONDS
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.registration import Registry
from kvxfer.server.state import PullEntry
from kvxfer.wire import common_pb2, local_pb2, peer_pb2
from kvxfer.wire.convert import rank_to_proto
from kvxfer.wire.status import error_of

__all__ = ["FENCE_MARGIN_S", "PushSteps"]

log = get_logger("kvxfer.server")
I64 = npt.NDArray[np.int64]
#: The pull's check that a handshaken source is the rank and engine it should be (raises when not).
CheckRank = Callable[[PullEntry, int, PeerSession], None]
#: How long past an unreachable writer's offer deadline the fence still waits (clock rates differ).
FENCE_MARGIN_S = 1.0


class PushSteps:
    """The steps of a pull in push mode (see the module docs)."""

    def __init__(self, registry: Registry, peers: PeerDirectory) -> None:
        self.registry = registry
        self.peers = peers

    async def run(
        self, entry: PullEntry, ranks: list[int], sessions: dict[int, PeerSession], check_rank: CheckRank
    ) -> local_pb2.TransferStats:
        """Offer, wait for every Landed, and fence on any other outcome (``check_rank``: the pull's peer check)."""
        req_blocks, writer_blocks = entry.offer
        loop = asyncio.get_running_loop()
        for q in ranks:
            entry.landed[entry.addresses[q]] = loop.create_future()
        answered: dict[str, float] = {}  # address -> when its offer was answered (or failed)
        offered: dict[str, float] = {}  # address -> seconds the writer was given
        try:
            entry.stage = "offering to " + ", ".join(entry.addresses[q] for q in ranks)
            await asyncio.gather(*(self._offer(entry, q, req_blocks, writer_blocks, sessions, check_rank, answered,
                                               offered) for q in ranks))  # fmt: skip
            if not entry.posted.done():
                entry.posted.set_result(None)
            entry.stage = "waiting for the writes of " + ", ".join(entry.addresses[q] for q in ranks)
            notices = [await entry.landed[entry.addresses[q]] for q in ranks]
        except BaseException:
            await _unstoppable(self._fence(entry, answered, offered))
            raise
        for q, notice in zip(ranks, notices, strict=True):
            if notice.code:
                await _unstoppable(self._fence(entry, answered, offered))
                err = error_of(notice.code, f"push from {entry.addresses[q]} failed: {notice.message}", notice.reason,
                               "remote_addresses")  # fmt: skip
                raise err  # another writer's WRITE that may still land (entry.unfenced): pull_failures says so
        entry.stage = "done"
        return local_pb2.TransferStats(
            bytes=sum(n.bytes for n in notices), descriptors=sum(n.descriptors for n in notices),
            duration_seconds=time.monotonic() - entry.started,
            data_seconds=max((n.data_seconds for n in notices), default=0.0), remote_ranks=ranks,
        )  # fmt: skip

    async def _offer(
        self, entry: PullEntry, q: int, req_blocks: list[common_pb2.BlockList],
        writer_blocks: list[common_pb2.BlockList], sessions: dict[int, PeerSession], check_rank: CheckRank,
        answered: dict[str, float], offered: dict[str, float],
    ) -> None:  # fmt: skip
        """Offer to remote rank ``q``; once more after a fresh handshake if the writer forgot this rank."""
        try:
            await self._offer_once(entry, q, req_blocks, writer_blocks, sessions, check_rank, answered, offered)
        except KvxferError as exc:
            if exc.reason is not Reason.NOT_HANDSHAKEN:
                raise
            # The writer forgot this rank (it restarted, or had too many readers): handshake again.
            self.peers.invalidate(entry.addresses[q])
            await self._offer_once(entry, q, req_blocks, writer_blocks, sessions, check_rank, answered, offered)

    async def _offer_once(
        self, entry: PullEntry, q: int, req_blocks: list[common_pb2.BlockList],
        writer_blocks: list[common_pb2.BlockList], sessions: dict[int, PeerSession], check_rank: CheckRank,
        answered: dict[str, float], offered: dict[str, float],
    ) -> None:  # fmt: skip
        address = entry.addresses[q]
        session = await self.peers.session(address, budget=max(entry.deadline - time.monotonic(), 0.001))
        check_rank(entry, q, session)
        sessions[q] = session
        entry.writers[address] = session.identity
        me = self.registry.identity()
        timeout = max(entry.deadline - time.monotonic(), 0.001)
        req = peer_pb2.OfferRequest(
            request_id=entry.request_id, engine_id=me.engine_id, instance_id=me.instance_id,
            rank=rank_to_proto(me.rank), epoch=me.epoch, blocks=req_blocks, writer_blocks=writer_blocks,
            timeout_seconds=timeout, writer_engine_id=session.identity.engine_id,
        )  # fmt: skip
        if address not in entry.asked:
            entry.asked.append(address)  # from here on the writer may hold the offer: the fence must reach it
        offered[address] = timeout
        try:
            await self.peers.call(address, "Offer", lambda s: s.Offer(req, timeout=min(timeout, PEER_CALL_SECONDS),
                                                                     metadata=self.peers.metadata))  # fmt: skip
        finally:
            answered[address] = time.monotonic()

    async def _fence(self, entry: PullEntry, answered: dict[str, float], offered: dict[str, float]) -> None:
        """Take back every offer not landed; wait out the deadline of writers that cannot be reached."""
        # A landed future is cancelled with the task that awaited it: that writer has not answered.
        open_offers = [a for a in entry.asked if not (a in entry.landed and _answered(entry.landed[a]))]
        if not open_offers:
            return
        entry.stage = "revoking the offers to " + ", ".join(open_offers)
        me = self.registry.identity()
        # A writer answers once its cancelled WRITE was fenced, up to its fence budget (taken to be ours).
        fence = self.registry.settings.fence_budget_seconds
        req = peer_pb2.RevokeRequest(request_id=entry.request_id, engine_id=me.engine_id, instance_id=me.instance_id,
                                     rank=rank_to_proto(me.rank), reason=entry.abort_reason or "")  # fmt: skip

        async def revoke(address: str) -> float:
            try:
                resp = await self.peers.call(address, "Revoke", lambda s: s.Revoke(
                    req, timeout=PEER_CALL_SECONDS + fence, metadata=self.peers.metadata))  # fmt: skip
                if resp.unfenced:
                    # A WRITE of the offer may still land in these blocks: the pull's error says so (pull_failures).
                    entry.unfenced = True
                    log.warning("a revoked offer's WRITE may still land", extra={"peer": address})
                return 0.0
            except KvxferError as exc:
                if exc.reason is Reason.NOT_HANDSHAKEN:
                    # The writer does not know this rank (it restarted): it holds no offer of it, and
                    # refuses a Revoke only then, so nothing of it can land.
                    return 0.0
                # Unreachable: its offer lapses at its deadline, counted from no earlier than our send.
                until = answered.get(address, time.monotonic()) + offered.get(address, 0.0) + FENCE_MARGIN_S
                log.warning("could not revoke an offer; waiting out its deadline",
                            extra={"peer": address, "error": exc.message,
                                   "wait_seconds": round(max(until - time.monotonic(), 0.0), 3)})  # fmt: skip
                return until

        waits = await asyncio.gather(*(revoke(a) for a in open_offers))
        remaining = max(waits) - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)


def _answered(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled()


async def _unstoppable(coro: Any) -> None:
    """Run ``coro`` to its end even if the caller is cancelled meanwhile (the fence must finish)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
    task.result()


def landed_matches(them: Identity | None, req: peer_pb2.LandedRequest) -> bool:
    """A Landed notice comes from the writer offered to (its handshake; the caller's engine id is its credentials')."""
    if them is None:
        return False
    return (them.engine_id, them.instance_id, them.rank.tp_rank) == (req.engine_id, req.instance_id, req.rank.tp_rank)
