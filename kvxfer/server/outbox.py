"""Calls this sidecar makes to its peers: lookups, completion notices and aborts.

Every pull owes its publishers a lookup (``GetPublished``) and, when it ends, a notice
(``Notify``); both go through a per-peer :class:`~kvxfer.server.batching.Coalescer`, so that calls
owed to one peer while another is in flight leave together as one batch. Aborts and drops go
one by one. Nothing here decides anything from a message's text: failures carry their reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from kvxfer.errors import KvxferError, PeerUnavailableError, Reason
from kvxfer.logs import get_logger
from kvxfer.server.batching import Coalescer
from kvxfer.server.peers import PeerDirectory
from kvxfer.server.state import PublishEntry, PullEntry
from kvxfer.topology import RankInfo
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import rank_to_proto
from kvxfer.wire.status import error_of

__all__ = ["Outbox"]

log = get_logger("kvxfer.server")
PEER_CALL_SECONDS = 10.0  # cap on a single control-plane call to a peer
#: A DONE notice waits this long for others owed to the same publisher (it is off every critical
#: path: the worker has its answer, the publisher only frees blocks a little later). At a few
#: hundred pulls/s a gRPC call costs each side ~0.9 ms of CPU, so notices that leave together cut
#: the CPU per pull of both sidecars (docs/sidecar.md, "Stop 25"). FAILED and UNREAD notices go at
#: once: they free a publish nobody finished reading, and a retry's lookup must not overtake them
#: (it would READ blocks the late notice then frees under it).
NOTICE_LINGER_S = 0.005
LOOKUPS_PER_CALL = 64  # lookups a reader puts in one GetPublishedBatch (answers carry every block id)
Lookup = tuple[peer_pb2.GetPublishedRequest, float]  # the request and its pull's deadline (monotonic)


class Outbox:
    """Sends what this sidecar owes its peers (see the module docs); owns the background tasks."""

    def __init__(self, peers: PeerDirectory, *, engine_id: str, instance_id: str) -> None:
        self.peers = peers
        self.engine_id = engine_id
        self.instance_id = instance_id
        self._lookups: Coalescer[str, Lookup, Any] = Coalescer(self._send_lookups, self.spawn)
        self._done_notices: Coalescer[str, peer_pb2.NotifyRequest, None] = Coalescer(
            self._send_notices, self.spawn, linger=NOTICE_LINGER_S, on_dropped=_notices_dropped
        )
        self._notices: Coalescer[str, peer_pb2.NotifyRequest, None] = Coalescer(
            self._send_notices, self.spawn, on_dropped=_notices_dropped
        )
        self._unbatched: set[tuple[str, str]] = set()  # (address, instance) answering UNIMPLEMENTED to batches
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background (kept until it ends, awaited by :meth:`close`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self, timeout: float = 5.0) -> None:
        """Wait a little for what is still being sent."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)

    # ------------------------------------------------------------------ lookups
    async def lookup(self, address: str, req: peer_pb2.GetPublishedRequest, deadline: float) -> Any:
        """GetPublished at ``address`` (batched with other pulls' lookups of that peer)."""
        return await self._lookups.submit(address, (req, deadline))

    async def _send_lookups(self, address: str, asks: list[Lookup]) -> list[Any]:
        """GetPublished for every queued pull of one peer: one call, or one GetPublishedBatch for several."""
        if len(asks) > LOOKUPS_PER_CALL:
            n = LOOKUPS_PER_CALL
            chunks = [asks[i : i + n] for i in range(0, len(asks), n)]
            parts = await asyncio.gather(*(self._send_lookups(address, c) for c in chunks), return_exceptions=True)
            # A chunk that failed as a whole fails its own lookups only.
            return [r for c, part in zip(chunks, parts, strict=True) for r in (
                [part] * len(c) if isinstance(part, BaseException) else part)]  # fmt: skip
        # The call may run as long as the most patient pull in it; each pull still ends at its own deadline.
        timeout = min(max(max(d for _, d in asks) - time.monotonic(), 0.001), PEER_CALL_SECONDS)
        session = self.peers.current(address)
        peer = (address, session.identity.instance_id if session else "")
        if len(asks) > 1 and peer not in self._unbatched:
            try:
                return await self._lookup_batch(address, asks, timeout)
            except KvxferError as exc:
                if exc.reason is not Reason.UNSUPPORTED:
                    raise
                self._unbatched.add(peer)  # an older kvxfer (until it restarts): one request per call
        md = self.peers.metadata

        async def one(req: peer_pb2.GetPublishedRequest) -> Any:
            try:
                return await self.peers.call(
                    address, "GetPublished", lambda s: s.GetPublished(req, timeout=timeout, metadata=md)
                )
            except KvxferError as exc:
                return exc

        if len(asks) == 1:
            return [await one(asks[0][0])]
        return list(await asyncio.gather(*(one(r) for r, _ in asks)))

    async def _lookup_batch(self, address: str, asks: list[Lookup], timeout: float) -> list[Any]:
        batch = peer_pb2.GetPublishedBatchRequest(requests=[r for r, _ in asks])
        md = self.peers.metadata
        resp = await self.peers.call(
            address, "GetPublishedBatch", lambda s: s.GetPublishedBatch(batch, timeout=timeout, metadata=md)
        )
        if len(resp.results) != len(asks):  # what a peer sends is checked like a worker's input
            raise PeerUnavailableError(
                f"peer {address} answered {len(resp.results)} results to {len(asks)} lookups",
                field="remote_addresses", reason=Reason.PEER_INPUT,
            )  # fmt: skip
        return [
            r.response if r.code == 0 else error_of(
                r.code, f"GetPublished at peer {address}: {r.message}", r.reason, r.field or None)
            for r in resp.results
        ]  # fmt: skip

    # ------------------------------------------------------------------ notices
    def notify_publishers(self, entry: PullEntry, rank: RankInfo, outcome: str, message: str, nbytes: int) -> None:
        """Tell every publisher a pull contacted how it ended (and unread replicas to free their copy)."""
        kinds = {"done": peer_pb2.NotifyRequest.DONE, "failed": peer_pb2.NotifyRequest.FAILED}

        def request(kind: Any, msg: str, n: int) -> peer_pb2.NotifyRequest:
            return peer_pb2.NotifyRequest(
                request_id=entry.request_id, engine_id=self.engine_id, instance_id=self.instance_id,
                rank=rank_to_proto(rank), message=msg, bytes=n, outcome=kind,
            )  # fmt: skip

        queue = self._done_notices if outcome == "done" else self._notices
        for address in entry.contacted:
            queue.submit(address, request(kinds[outcome], message, nbytes))
        if entry.unread:
            unread = request(peer_pb2.NotifyRequest.UNREAD, "no decode rank reads this replica", 0)
            for address in entry.unread:
                self._notices.submit(address, unread)

    async def _send_notices(self, address: str, batch: list[peer_pb2.NotifyRequest]) -> list[None]:
        msg: Any
        if len(batch) == 1:
            what, msg = "Notify", batch[0]
        else:
            what, msg = "NotifyBatch", peer_pb2.NotifyBatchRequest(notices=batch)

        def send(stub: Any) -> Any:
            return getattr(stub, what)(msg, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)

        try:
            if any(n.outcome == peer_pb2.NotifyRequest.UNREAD for n in batch):
                # A replica this rank never read from only takes notices from a sidecar it knows.
                await self.peers.session(address, budget=PEER_CALL_SECONDS)
            await self.peers.call(address, what, send)
        except Exception as exc:  # nobody awaits a notice: whatever went wrong is logged here
            error = exc.message if isinstance(exc, KvxferError) else f"{type(exc).__name__}: {exc}"
            log.warning("completion notices not delivered; the peer's leases will expire", extra={
                "peer": address, "error": error, "notices": len(batch)})  # fmt: skip
        return [None] * len(batch)

    # ------------------------------------------------------------------ aborts
    def _abort_request(self, request_id: str, reason: str) -> peer_pb2.PeerAbortRequest:
        return peer_pb2.PeerAbortRequest(
            request_id=request_id, engine_id=self.engine_id, instance_id=self.instance_id, reason=reason
        )

    def abort_publishers(self, entry: PullEntry, reason: str) -> None:
        """A pull was aborted here: every publisher it asked drops its copy."""
        req = self._abort_request(entry.request_id, reason)
        for address in entry.asked:
            self.spawn(self.peer_abort(address, req))

    async def abort_readers(self, entry: PublishEntry, reason: str, skip: tuple[str, str] | None) -> bool:
        """A publish was aborted here: every reader that fetched it stops (but ``skip``, who asked).

        True when every one of them answered (it stopped reading, and dropped its grant).
        """
        req = self._abort_request(entry.request_id, reason)
        calls = [
            self.peer_abort(address, req)
            for (engine, instance, _tp, _pp), address in entry.readers.items()
            if skip != (engine, instance) and address
        ]
        return all(r is True for r in await asyncio.gather(*calls, return_exceptions=True))

    async def peer_abort(self, address: str, req: peer_pb2.PeerAbortRequest) -> bool:
        """Abort at one peer; False when it did not answer (logged: the peer's lease or deadline still ends it)."""
        try:
            await self.peers.call(
                address, "Abort", lambda s: s.Abort(req, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)
            )
        except KvxferError as exc:
            log.warning("could not tell a peer about an abort", extra={"peer": address, "error": exc.message})
            return False
        return True

    async def drop_remote(self, address: str, request_id: str, reason: str, rank: RankInfo | None = None) -> bool:
        """Ask a publisher to drop a request this side will not read (handshaking first if needed).

        A publisher that does not hold it (``Abort`` found nothing) may not have published it *yet*: a
        push-mode request whose decode side needs none of it, or gave up while queued, before its
        prefill finished. An ``Abort`` of that is forgotten, so this side (``rank``: its own) then
        takes back its claim on a push of it (``Revoke``), which a writer remembers: the publish, when
        it comes, is freed at once instead of at its lease's end. A second ``Abort`` catches a publish
        that came between the two.
        """
        req = self._abort_request(request_id, reason)

        async def abort() -> bool:
            resp = await self.peers.call(
                address, "Abort", lambda s: s.Abort(req, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)
            )
            return bool(resp.found)

        try:
            # A publisher takes aborts only from a reader that handshook with it.
            await self.peers.session(address, budget=PEER_CALL_SECONDS)
            if await abort():
                return True
            if rank is None:
                return False
            revoke = peer_pb2.RevokeRequest(
                request_id=request_id, engine_id=self.engine_id, instance_id=self.instance_id,
                rank=rank_to_proto(rank), reason=reason,
            )  # fmt: skip
            try:
                await self.peers.call(address, "Revoke", lambda s: s.Revoke(revoke, timeout=PEER_CALL_SECONDS,
                                                                           metadata=self.peers.metadata))  # fmt: skip
            except KvxferError as exc:  # an older publisher (no push), or one that refused: its lease frees it
                log.info("could not tell a publisher that this side gave up on a request it may publish later",
                         extra={"peer": address, "error": exc.message})  # fmt: skip
            return await abort()
        except KvxferError as exc:
            log.warning("could not ask a publisher to drop a request; its lease will expire",
                        extra={"peer": address, "error": exc.message})  # fmt: skip
            return False


def _notices_dropped(address: str, n: int) -> None:
    # Nobody awaits a notice, so this is the only trace of one the sidecar closed under (lingering
    # or in flight): the publisher frees those publishes only when their leases expire.
    log.warning("completion notices dropped: the sidecar closed before they were sent or answered; the peer's "
                "leases will expire", extra={"peer": address, "notices": n})  # fmt: skip
