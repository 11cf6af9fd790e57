"""The prefill side: publishes under leases, and the peer API that readers call about them.

A worker *publishes* a request's blocks; they are held under a lease until every decode rank
that reads them confirms (peer ``Notify``), the lease expires, or someone aborts. Readers first
handshake (:meth:`~kvxfer.server.readers.Readers.handshake`, the publisher's :attr:`~Publisher.readers`),
then look the request up (``GetPublished``): only a reader that handshook learns block ids and
region tables, and only a reader that fetched a request may free it.

A publish is *bound* to one reader engine: the one the worker named (``reader_engine_id``), else
the first that fetches, frees or aborts it. Every other engine is refused (PERMISSION_DENIED,
reason NOT_BOUND_READER). Which engine a caller is comes from its credentials
(:class:`~kvxfer.server.peer_auth.PeerCredentials`): with mutual TLS, its certificate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from kvxfer.config import Settings
from kvxfer.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvxferError,
    NotFoundError,
    PermissionDeniedError,
    Reason,
)
from kvxfer.logs import get_logger, log_context
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.events import CompletionHub, Kind
from kvxfer.server.identity import Identity
from kvxfer.server.outbox import Outbox
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.server.readers import Readers, expected_readers
from kvxfer.server.registration import Registry
from kvxfer.server.state import PublishEntry, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import check_lease, check_outcome
from kvxfer.topology import RankInfo
from kvxfer.wire import local_pb2, peer_pb2
from kvxfer.wire.convert import blocks_from_proto, check_id, check_reader_engine_id, rank_from_proto
from kvxfer.wire.status import code_of

__all__ = ["MAX_BATCH", "Publisher"]

log = get_logger("kvxfer.server")
MAX_BATCH = 1024  # items in one PullBatch, GetPublishedBatch, NotifyBatch or Hold


class Publisher:
    """Owns the publishes (leases) and, in :attr:`readers`, the readers that handshook (see the module docs)."""

    def __init__(
        self, settings: Settings, registry: Registry, hub: CompletionHub, metrics: SidecarMetrics, outbox: Outbox,
        topologies: TopologyCache,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.registry = registry
        self.hub = hub
        self.metrics = metrics
        self.outbox = outbox
        self.topologies = topologies
        self.publishes: dict[str, PublishEntry] = {}
        #: Dropped publishes whose blocks are not the worker's yet: their readers are being told
        #: (see _free_after_readers). GetStatus still reports them as held.
        self.freeing: dict[str, PublishEntry] = {}
        #: Sidecars that handshook us (the peer ``Handshake`` is theirs: :meth:`Readers.handshake`).
        self.readers = Readers(registry, metrics)
        #: Called with (request id, why) when a publish is dropped before its readers finished (push mode).
        self.on_dropped: Callable[[str, str], None] = lambda _rid, _why: None

    # ------------------------------------------------------------------ local API
    def publish(self, req: local_pb2.PublishRequest) -> local_pb2.PublishResponse:
        """Hold a request's blocks under a lease."""
        reg = self.registry.require()
        rid = check_id(req.request_id, "request_id")
        lease = check_lease(float(req.lease_seconds)) or self.settings.lease_seconds
        old = self.publishes.get(rid)
        if old is not None:
            raise AlreadyExistsError(
                f"request_id: {rid!r} is already published (lease expires in "
                f"{max(0.0, old.expires_at - time.monotonic()):.1f}s)",
                field="request_id",
            )
        blocks = blocks_from_proto(req.blocks, reg.layouts, "blocks")
        reader = check_reader_engine_id(req.reader_engine_id, "reader_engine_id")
        now = time.monotonic()
        origins = {bl.group: int(bl.skip_tokens) for bl in req.blocks if bl.skip_tokens}
        entry = PublishEntry(rid, blocks, lease, now + lease, reader_engine=reader, published_at=now, origins=origins)
        self.publishes[rid] = entry
        self._arm_lease(entry)
        return local_pb2.PublishResponse(request_id=rid, expires_unix_ms=entry.expires_unix_ms)

    def release(self, rid: str) -> bool:
        """Drop a publish (the worker frees the blocks itself); False when none was held."""
        return self.drop(rid, "released by the worker") is not None

    def abort(self, rid: str, reason: str) -> bool:
        """Drop a publish and stop its readers; False when none was held."""
        entry = self.drop(rid, reason)
        if entry is None:
            return False
        self._free_after_readers(entry, reason, skip=None)
        return True

    def _free_after_readers(
        self, entry: PublishEntry, reason: str, skip: tuple[str, str] | None, peer: str = ""
    ) -> None:
        """Tell a dropped publish's readers (but ``skip``), then let the worker free its blocks (ABORTED).

        A reader may hold a grant, or have looked the request up, and READ without asking again
        until the lease's end: the blocks stay the worker's until every reader answered that it
        stopped, or, if one did not, until the lease would have ended.
        """

        async def tell_then_free() -> None:
            try:
                if not await self.outbox.abort_readers(entry, reason, skip=skip):
                    await asyncio.sleep(max(entry.expires_at - time.monotonic(), 0.0))
            finally:
                if self.freeing.get(entry.request_id) is entry:
                    del self.freeing[entry.request_id]
            self.hub.emit(Kind.ABORTED, entry.request_id, code=grpc.StatusCode.ABORTED.value[0], message=reason,
                          peer=peer)  # fmt: skip

        self.freeing[entry.request_id] = entry
        self.outbox.spawn(tell_then_free())

    def holding(self, rid: str) -> PublishEntry | None:
        """The publish ``rid`` whose blocks are not the worker's to free: published, or being dropped."""
        return self.publishes.get(rid) or self.freeing.get(rid)

    def drop(self, rid: str, why: str = "released") -> PublishEntry | None:
        """Forget a publish and its lease timer (``why`` goes to the writes still waiting on it)."""
        entry = self.publishes.pop(rid, None)
        if entry is not None:
            if entry.timer is not None:
                entry.timer.cancel()
            self.on_dropped(rid, why)
        return entry

    def _arm_lease(self, entry: PublishEntry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        delay = max(0.0, entry.expires_at - time.monotonic())
        entry.timer = asyncio.get_running_loop().call_later(delay, self._expire, entry)

    def _expire(self, entry: PublishEntry) -> None:
        if self.publishes.get(entry.request_id) is not entry:
            return
        if entry.expires_at > time.monotonic() + 1e-3:  # extended meanwhile
            self._arm_lease(entry)
            return
        msg = f"lease of {entry.lease_seconds:g}s expired before the decode side confirmed; blocks released"
        self.drop(entry.request_id, msg)
        self.metrics.lease_expirations.inc()
        with log_context(request_id=entry.request_id):
            log.info("lease expired", extra={"lease_seconds": entry.lease_seconds})
        self.hub.emit(Kind.EXPIRED, entry.request_id, code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message=msg)

    def release_all(self, message: str) -> int:
        """Release every publish (a drain ran out); returns how many."""
        released = 0
        for rid in list(self.publishes):
            if self.drop(rid, message) is not None:
                released += 1
                with log_context(request_id=rid):
                    log.info("lease released by the drain")
                self.hub.emit(Kind.RELEASED, rid, code=grpc.StatusCode.UNAVAILABLE.value[0], message=message)
        return released

    # ------------------------------------------------------------------ peer API
    def get_published(
        self, req: peer_pb2.GetPublishedRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.GetPublishedResponse:
        """A reader asks for a published request's blocks and regions.

        Only a reader that handshook learns anything, even whether ``request_id`` is published: a
        caller that did not is refused (NOT_HANDSHAKEN) before the request is looked up.
        """
        rid = check_id(req.request_id, "request_id")
        creds.check(req.engine_id, "engine_id")
        reg = self.registry.require()
        rank = rank_from_proto(req.rank, "rank")
        key = (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank)
        reader = self.readers.use(key)
        if reader is None:
            raise FailedPreconditionError(
                f"engine_id: reader {req.engine_id!r} (instance {req.instance_id}) has not handshaken with this "
                "sidecar; handshake first",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        entry = self.publishes.get(rid)
        if entry is None:
            raise NotFoundError(
                f"request_id: {rid!r} is not published on {self.settings.engine_id} (unknown, released or expired)",
                field="request_id",
            )
        if req.epoch and req.epoch != reader.epoch:
            # The reader's worker registered again since the handshake: its layouts (and so who reads
            # what, and whether it may read at all) are checked again before anything is answered.
            raise FailedPreconditionError(
                f"epoch: reader {reader.label} registered again (epoch {req.epoch}) since its handshake (epoch "
                f"{reader.epoch}); handshake again",
                field="epoch", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        self._bind(entry, req.engine_id, "fetch")
        self._admit_reader(entry, reader, rank, reg)
        # Hold the blocks at least as long as this reader may take to read them.
        hold = time.monotonic() + self.settings.transfer_timeout_seconds
        if entry.expires_at < hold:
            entry.expires_at = hold
        resp = peer_pb2.GetPublishedResponse(
            request_id=rid, instance_id=self.registry.instance_id, epoch=reg.epoch,
            expires_unix_ms=entry.expires_unix_ms, held_seconds=max(entry.expires_at - time.monotonic(), 0.0),
        )  # fmt: skip
        for name, g in reg.groups.items():
            resp.groups.append(
                peer_pb2.PublishedGroup(
                    name=name, block_ids=entry.blocks[name].tolist(), regions=self.registry.regions_of(name, reg),
                    memory_type=g.memory.mem_type,
                )
            )  # fmt: skip
        return resp

    def _admit_reader(self, entry: PublishEntry, reader: Identity, rank: RankInfo, reg: Registration) -> None:
        """``reader`` learned the request's block ids: it may free it, and who must confirm is known.

        The reader's TP size is its handshake's (checked there), not the one a later call names.
        """
        tp_size = reader.rank.tp_size
        if entry.expected_readers is None or entry.reader_tp_size != tp_size:
            entry.expected_readers = expected_readers(self.topologies, reader, tp_size, reg)
            entry.reader_tp_size = tp_size
        entry.readers[(reader.engine_id, reader.instance_id, rank.tp_rank, rank.pp_rank)] = reader.address

    def get_published_batch(
        self, req: peer_pb2.GetPublishedBatchRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.GetPublishedBatchResponse:
        """Several lookups, each answered (or refused) on its own."""
        if len(req.requests) > MAX_BATCH:
            raise InvalidArgumentError(
                f"requests: {len(req.requests)} lookups in one GetPublishedBatch; at most {MAX_BATCH}",
                field="requests",
            )
        out = peer_pb2.GetPublishedBatchResponse()
        for r in req.requests:
            try:
                out.results.add(response=self.get_published(r, creds))
            except KvxferError as exc:  # one unknown request must not cost the others
                out.results.add(code=code_of(exc).value[0], message=exc.message, reason=exc.reason.value,
                                field=exc.field or "")  # fmt: skip
        return out

    def notify(self, req: peer_pb2.NotifyRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.NotifyResponse:
        """A reader is done (or gave up, or reads another replica): free the blocks once every expected reader is.

        A caller that neither handshook nor fetched the request is refused (NOT_HANDSHAKEN) the same
        way whether it is published or not: a notice tells it nothing about which requests are.
        """
        rid = check_id(req.request_id, "request_id")
        check_outcome(req.outcome)  # before anything else: a missing outcome must not read as DONE
        creds.check(req.engine_id, "engine_id")
        rank = rank_from_proto(req.rank, "rank")
        entry = self.publishes.get(rid)
        fetched = entry is not None and (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank) in entry.readers
        if not fetched and not self.readers.knows(req.engine_id, req.instance_id):
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}) has not handshaken with this sidecar; "
                f"notice of {rid!r} refused",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        if entry is None:
            return peer_pb2.NotifyResponse(released=False)
        unread = req.outcome == peer_pb2.NotifyRequest.UNREAD
        self._check_bound(entry, req.engine_id, "free")  # refused before anything else: no binding on a refusal
        self._check_notifier(req, rank, entry, unread)
        self._bind(entry, req.engine_id, "free")
        if unread:
            if entry.readers:
                return peer_pb2.NotifyResponse(released=False)  # someone did read it: wait for them
            self.drop(rid)
            msg = f"no rank of {req.engine_id} reads this rank's copy (replicated elsewhere); released"
            self.hub.emit(Kind.RELEASED, rid, message=msg, peer=req.engine_id)
            return peer_pb2.NotifyResponse(released=True)
        failure = req.message if req.outcome == peer_pb2.NotifyRequest.FAILED else None
        return peer_pb2.NotifyResponse(released=self._reader_done(entry, req.engine_id, rank, failure))

    def _reader_done(self, entry: PublishEntry, engine_id: str, rank: RankInfo, failure: str | None) -> bool:
        """A reader rank has its bytes (or gave up): free the blocks once every expected one did; True when freed."""
        entry.done_readers.add(rank.tp_rank)
        if failure is not None:
            entry.failures.append(f"{engine_id}[tp {rank.tp_rank}]: {failure}")
        expected = entry.expected_readers or {rank.tp_rank}
        if not expected <= entry.done_readers:
            return False
        self.drop(entry.request_id)
        if entry.failures:
            code = grpc.StatusCode.UNAVAILABLE.value[0]
            msg = "decode side gave up: " + "; ".join(entry.failures) + "; blocks released"
        else:
            code, msg = 0, f"decode side ({engine_id}) has the blocks; released"
        self.hub.emit(Kind.RELEASED, entry.request_id, code=code, message=msg, peer=engine_id)
        return True

    # ------------------------------------------------------------------ push mode (kvxfer.server.pusher)
    def check_writable(self, rid: str, engine_id: str) -> None:
        """Refuse an offer for a publish bound to another reader engine (PERMISSION_DENIED)."""
        entry = self.publishes.get(rid)
        if entry is not None:
            self._check_bound(entry, engine_id, "offer blocks for")

    def admit_writer(self, rid: str, reader: Identity, rank: RankInfo) -> PublishEntry:
        """A reader's offer of ``rid`` is about to be written: bind the publish to it and hold it for the WRITE."""
        entry = self.publishes.get(rid)
        if entry is None:
            raise NotFoundError(
                f"request_id: {rid!r} is not published on {self.settings.engine_id} (released, expired or aborted)",
                field="request_id",
            )
        self._bind(entry, reader.engine_id, "be written")
        self._admit_reader(entry, reader, rank, self.registry.require())
        hold = time.monotonic() + self.settings.transfer_timeout_seconds
        if entry.expires_at < hold:
            entry.expires_at = hold
        return entry

    def release_unwanted(self, rid: str, why: str) -> None:
        """Free a publish every reader gave up on before it existed (push mode: all offers revoked)."""
        if self.drop(rid, why) is not None:
            with log_context(request_id=rid):
                log.info("publish released: its readers gave up before it", extra={"reason": why})
            self.hub.emit(Kind.RELEASED, rid, code=grpc.StatusCode.UNAVAILABLE.value[0], message=f"{why}; released")

    def reader_finished(self, rid: str, engine_id: str, rank: RankInfo, failure: str | None) -> bool:
        """A push into a reader rank ended (``failure`` None: it landed); True when that freed the blocks."""
        entry = self.publishes.get(rid)
        if entry is None or (entry.reader_engine and entry.reader_engine != engine_id):
            return False
        return self._reader_done(entry, engine_id, rank, failure)

    def _check_notifier(self, req: peer_pb2.NotifyRequest, rank: RankInfo, entry: PublishEntry, unread: bool) -> None:
        # Only a reader that handshook (UNREAD) or fetched this request (DONE/FAILED) may free its blocks.
        if unread:
            known = self.readers.knows(req.engine_id, req.instance_id)
        else:
            known = (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank) in entry.readers
        if not known:
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}, tp rank {rank.tp_rank}) "
                f"{'has not handshaken with' if unread else 'did not fetch'} {req.request_id!r} from this sidecar; "
                "notice refused",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip

    def notify_batch(
        self, req: peer_pb2.NotifyBatchRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.NotifyBatchResponse:
        """Several notices at once; a bad one does not cost the others (more than MAX_BATCH: refused whole)."""
        if len(req.notices) > MAX_BATCH:
            # Checked before any notice: each is worked through (and a refused one logged) in turn.
            raise InvalidArgumentError(f"notices: {len(req.notices)} notices in one NotifyBatch; at most {MAX_BATCH}",
                                       field="notices")  # fmt: skip
        released = 0
        for n in req.notices:
            try:
                released += int(self.notify(n, creds).released)
            except KvxferError as exc:
                log.warning("completion notice refused", extra={"peer": n.engine_id, "error": exc.message})
        return peer_pb2.NotifyBatchResponse(released=released)

    def peer_abort(self, req: peer_pb2.PeerAbortRequest, reason: str) -> bool:
        """A reader aborted: drop the publish and stop the other readers; False when none was held."""
        entry = self.publishes.get(req.request_id)
        if entry is None:
            return False
        self._bind(entry, req.engine_id, "abort")
        self.drop(req.request_id, reason)
        self._free_after_readers(entry, reason, skip=(req.engine_id, req.instance_id), peer=req.engine_id)
        return True

    def hold(self, req: peer_pb2.HoldRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.HoldResponse:
        """A reader still wants these requests: extend each lease, bounded by --max-hold-seconds."""
        creds.check(req.engine_id, "engine_id")
        if len(req.request_ids) > MAX_BATCH:
            raise InvalidArgumentError(f"request_ids: {len(req.request_ids)} ids in one Hold; at most {MAX_BATCH}",
                                       field="request_ids")  # fmt: skip
        rank = rank_from_proto(req.rank, "rank") if req.HasField("rank") else None
        reader = self.readers.use((req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank)) if rank else None
        if not self.readers.knows(req.engine_id, req.instance_id) or (rank is not None and reader is None):
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}) has not handshaken with this sidecar; "
                "hold refused",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        reg = self.registry.require()
        out = peer_pb2.HoldResponse(instance_id=self.registry.instance_id, epoch=reg.epoch)
        now = time.monotonic()
        for rid in req.request_ids:
            entry = self.publishes.get(rid)
            if entry is None or (entry.reader_engine and entry.reader_engine != req.engine_id):
                continue  # gone, or another reader's: not held (the reader stops holding it)
            entry.reader_engine = req.engine_id
            until = min(now + entry.lease_seconds, entry.published_at + self.settings.max_hold_seconds)
            if until > entry.expires_at:
                entry.expires_at = until  # the lease timer re-arms itself when it fires early
            out.held.append(rid)
            out.expires_unix_ms.append(entry.expires_unix_ms)
            if reader is not None and rank is not None:
                # A grant: the ids and how long they stay held, so the reader may READ without a lookup.
                self._admit_reader(entry, reader, rank, reg)
                out.grants.add(
                    request_id=rid, held_seconds=max(entry.expires_at - now, 0.0),
                    groups=[peer_pb2.PublishedGroup(name=n, block_ids=ids.tolist()) for n, ids in entry.blocks.items()],
                )  # fmt: skip
        return out

    @classmethod
    def _bind(cls, entry: PublishEntry, engine_id: str, what: str) -> None:
        """Bind ``entry`` to ``engine_id`` when it is unbound; refuse any other engine."""
        cls._check_bound(entry, engine_id, what)
        entry.reader_engine = engine_id

    @staticmethod
    def _check_bound(entry: PublishEntry, engine_id: str, what: str) -> None:
        if entry.reader_engine and entry.reader_engine != engine_id:
            raise PermissionDeniedError(
                f"engine_id: {entry.request_id!r} is bound to reader engine {entry.reader_engine!r}; "
                f"{engine_id!r} may not {what} it",
                field="engine_id", reason=Reason.NOT_BOUND_READER,
            )  # fmt: skip

    def knows(self, engine_id: str, instance_id: str) -> bool:
        """True when that sidecar instance handshook with this one (:meth:`Readers.knows`)."""
        return self.readers.knows(engine_id, instance_id)

    def count_readers(self) -> int:
        """Reader sidecar instances that handshook (for the peers gauge)."""
        return self.readers.count_instances()  # called from the metrics server's thread: one len() of a dict
