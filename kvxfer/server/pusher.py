"""The writer's side of push mode: the offers readers made, and the WRITEs into them.

A decode rank *offers* the blocks it allocated for a request (peer ``Offer``). The offer is bound to
the reader that made it: its engine id comes from its credentials, it must have handshaken at the
registration epoch it names, and its blocks are checked against the layout of that handshake
before anything is kept. Once the request is published here (before or after the offer came), the
sidecar plans the reader's pull restricted to this rank (what :class:`~kvxfer.topology.PushTopology`
does for every receiver), WRITEs it (to the reader's agent on the data plane,
:class:`~kvxfer.server.reader_agents.ReaderAgents`) and calls the reader's ``Landed``. Every offer
ends in exactly one Landed, done or failed, unless the reader revoked it.

A reader that gave up takes its offer back (``Revoke``). The answer comes once no WRITE of the
offer is in flight and none will start, so the reader may reuse its blocks after it. An offer also
lapses at its deadline: no WRITE starts, or keeps running, past it. Only a reader that handshook (or
holds an offer under the rank it names) may revoke. A request that every offer gave up on before it
was published is remembered with the engine that gave up, for a while (at most
:data:`GIVEN_UP_KEPT` of them, in :class:`~kvxfer.server.give_ups.GiveUps`): its publish, when it
comes, is freed at once only if it is unbound or bound to that engine, so no other reader can give
up a publish meant for someone else. A publish dropped here (aborted, released, expired, the worker
gone) fails the offers waiting on it, and a worker that exits fails the offers of every request it
had not published yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import numpy as np
import numpy.typing as npt

from kvxfer.config import Settings
from kvxfer.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineError,
    FailedPreconditionError,
    KvxferError,
    PeerUnavailableError,
    Reason,
)
from kvxfer.logs import get_logger, log_context
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.give_ups import GiveUps
from kvxfer.server.identity import Identity
from kvxfer.server.landed import UNFENCED_WRITE, LandedNotices, amend_unfenced
from kvxfer.server.outbox import Outbox
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.server.peers import PeerDirectory
from kvxfer.server.publisher import Publisher
from kvxfer.server.push_rows import group_rows, offer_rows, token_span
from kvxfer.server.reader_agents import ReaderAgents
from kvxfer.server.recent import RecentMemo
from kvxfer.server.registration import Registry
from kvxfer.server.state import Offer, ReaderKey, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import check_timeout, remote_blocks, token_spans
from kvxfer.topology import RankInfo
from kvxfer.transport import Transport, cancelled_unfenced, mem_type
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import blocks_from_proto, check_id, rank_from_proto

__all__ = ["GIVEN_UP_KEPT", "UNFENCED_WRITE", "Offer", "Pusher", "token_span"]

log = get_logger("kvxfer.server")
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: The most (request, engine) pairs remembered as given up before their publish; the oldest go first.
GIVEN_UP_KEPT = 4096
#: The most characters of a reader's Revoke reason kept (it ends up in the publish's completion message).
REASON_CHARS = 512


class Pusher:
    """Owns the offers this sidecar holds as a writer (see the module docs)."""

    def __init__(
        self, settings: Settings, registry: Registry, data_plane: Transport, publisher: Publisher, peers: PeerDirectory,
        outbox: Outbox, metrics: SidecarMetrics, topologies: TopologyCache,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.registry = registry
        self.dp = data_plane
        self.publisher = publisher
        self.outbox = outbox
        self.notices = LandedNotices(settings, registry, peers, outbox)
        self.metrics = metrics
        self.topologies = topologies
        self.offers: dict[str, dict[ReaderKey, Offer]] = {}
        #: The readers written into, loaded on the data plane once per instance and epoch.
        self._loaded = ReaderAgents(data_plane)
        self._ids = itertools.count(1)
        #: Requests whose every offer was revoked before they were published here: (request id, the
        #: engine that gave up) -> why. Their publish, when it comes unbound or bound to that engine, is
        #: released at once (nobody will take it). Kept as long as their reader could have waited for it.
        remembered = settings.transfer_timeout_seconds + settings.lease_seconds
        self._given_up = GiveUps(kept=GIVEN_UP_KEPT, seconds=remembered)
        #: Offers the layer-wise stream completed before their publish (Landed already sent): request id
        #: -> [(reader, its rank, when)]. The publish, when it comes, counts them as done readers.
        self._landed_early: dict[str, list[tuple[Identity, RankInfo, float]]] = {}
        #: Offers ended here whose layer WRITEs are still stopping: a Revoke of one waits for them.
        self._stopping: dict[tuple[str, ReaderKey], tuple[Offer, list[asyncio.Task[None]]]] = {}
        #: Requests the worker aborted before publishing them here (its prefill was aborted or failed):
        #: request id -> why, kept like the give-ups (as long as an offer for one could still come). An
        #: offer for one is refused: nothing will ever be written into it.
        self._abandoned: RecentMemo[str, str] = RecentMemo(kept=GIVEN_UP_KEPT, seconds=remembered)

    def __len__(self) -> int:
        return sum(len(v) for v in self.offers.values())

    # ------------------------------------------------------------------ peer API
    def offer(self, req: peer_pb2.OfferRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.OfferResponse:
        """A reader offers its blocks for a request; the WRITEs start once it is published here."""
        rid = check_id(req.request_id, "request_id")
        creds.check(req.engine_id, "engine_id")
        reg = self.registry.require()
        if req.writer_engine_id and req.writer_engine_id != self.settings.engine_id:
            raise FailedPreconditionError(
                f"writer_engine_id: the offer is for engine {req.writer_engine_id!r}; this sidecar is "
                f"{self.settings.engine_id!r}",
                field="writer_engine_id", reason=Reason.PEER_MISMATCH,
            )  # fmt: skip
        rank = rank_from_proto(req.rank, "rank")
        key: ReaderKey = (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank)
        reader = self.publisher.readers.use(key)
        if reader is None or req.epoch != reader.epoch:
            seen = "has not handshaken" if reader is None else f"handshook at epoch {reader.epoch}, not {req.epoch},"
            raise FailedPreconditionError(
                f"engine_id: reader {req.engine_id!r} (instance {req.instance_id!r}, tp rank {rank.tp_rank}) {seen} "
                "with this sidecar; handshake first",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        missing = [n for n in reg.groups if n not in reader.regions]
        if missing:
            raise FailedPreconditionError(
                f"info.groups[{missing[0]}].regions: the reader's handshake carried no regions; it cannot be written",
                field="info", reason=Reason.PEER_INPUT,
            )  # fmt: skip
        blocks = blocks_from_proto(req.blocks, reader.groups, "blocks")
        given = remote_blocks(req.writer_blocks, reg.layouts, push=True, field="writer_blocks")
        limit = self.settings.transfer_timeout_seconds
        timeout = min(check_timeout(float(req.timeout_seconds)) or limit, limit)
        if key in self.offers.get(rid, {}):
            raise AlreadyExistsError(f"request_id: {rid!r} is already offered by this reader rank", field="request_id")
        self.publisher.check_writable(rid, req.engine_id)
        abandoned = self._abandoned.get(rid)
        if abandoned is not None:
            raise AbortedError(f"request_id: {rid!r} will not be published on {self.settings.engine_id}: "
                               f"{abandoned}", field="request_id")  # fmt: skip
        now = time.monotonic()
        offer = Offer(f"{self.registry.instance_id[:8]}-w{next(self._ids)}", rid, key, reader, rank, blocks,
                      token_spans(req.blocks, req.writer_blocks), given, now + timeout)  # fmt: skip
        self.offers.setdefault(rid, {})[key] = offer
        offer.timer = asyncio.get_running_loop().call_later(timeout, self._lapse, offer)
        published = rid in self.publisher.publishes
        if published:
            self._start(offer, reg)
        return peer_pb2.OfferResponse(published=published)

    async def revoke(self, req: peer_pb2.RevokeRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.RevokeResponse:
        """The reader takes its offer back; answered once no WRITE of it is in flight and none will start.

        Only from a reader that handshook with this sidecar, or whose offer (or its stopping WRITEs)
        this sidecar still holds under the rank it names; others are refused (FAILED_PRECONDITION,
        NOT_HANDSHAKEN), which tells the reader too that no offer of it is held here.
        """
        rid = check_id(req.request_id, "request_id")
        engine_id = check_id(req.engine_id, "engine_id")
        creds.check(engine_id, "engine_id")
        instance_id = check_id(req.instance_id, "instance_id")
        rank = rank_from_proto(req.rank, "rank")
        key: ReaderKey = (engine_id, instance_id, rank.tp_rank, rank.pp_rank)
        offer = self.offers.get(rid, {}).get(key)
        stopping = self._stopping.get((rid, key))
        if offer is None and not stopping and key not in self.publisher.readers.ranks:
            raise FailedPreconditionError(
                f"engine_id: reader {engine_id!r} (instance {instance_id!r}, tp rank {rank.tp_rank}) has not "
                f"handshaken with this sidecar and holds no offer of {rid!r} here; revoke refused",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        why = req.reason[:REASON_CHARS] or "the reader revoked its offer"
        if offer is None:
            unfenced = False
            if stopping:  # ended here a moment ago: answer once none of its WRITEs can still land
                await asyncio.wait(stopping[1])
                unfenced = stopping[0].unfenced
            if rid not in self.publisher.publishes and not self.offers.get(rid):
                # Its offer lapsed (or never came): a publish that comes later is still nobody's.
                self._given_up.remember(rid, engine_id, f"{engine_id} gave up on it before it was published")
            return peer_pb2.RevokeResponse(found=False, unfenced=unfenced)
        offer.revoked = True
        self._forget(offer)
        running = offer.cancel_streams()
        if offer.task is not None and not offer.task.done():
            offer.task.cancel()
            running.append(offer.task)
        for task in running:  # their transfers are cancelled with them
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        if rid in self.publisher.publishes:
            self.publisher.reader_finished(rid, engine_id, rank, f"{why} (revoked)")
        elif not self.offers.get(rid):
            self._given_up.remember(rid, engine_id, f"{engine_id} gave up on it before it was published ({why})")
        with log_context(request_id=rid, transfer_id=offer.transfer_id, peer=offer.reader.label):
            log.info("offer revoked", extra={"wrote": offer.wrote, "reason": why, "unfenced": offer.unfenced})
        return peer_pb2.RevokeResponse(found=True, wrote=offer.wrote, unfenced=offer.unfenced)

    # ------------------------------------------------------------------ local events
    def abandon(self, rid: str, why: str) -> int:
        """The worker aborted ``rid`` before publishing it here (its prefill ended otherwise): it never will.

        Every offer waiting for it fails now (its reader hears ``Landed`` with ABORTED once the layer
        WRITEs it was streamed stopped) rather than at its deadline, and an offer that comes later
        is refused. Returns how many offers failed.
        """
        self._abandoned.put(rid, why)
        self._landed_early.pop(rid, None)  # its readers have every byte; no publish will count them
        waiting = [o for o in self.offers.get(rid, {}).values() if o.task is None]
        for offer in waiting:
            self._fail(offer, AbortedError(f"request_id: the push of {rid!r} stopped before it was published: {why}",
                                           field="request_id"))  # fmt: skip
        if waiting:
            with log_context(request_id=rid):
                log.info("push offers failed: the request will not be published here",
                         extra={"offers": len(waiting), "reason": why})  # fmt: skip
        return len(waiting)

    def published(self, rid: str) -> None:
        """``rid`` was published here: write every offer that waited for it (or free it if all gave up)."""
        self._abandoned.pop(rid)
        entry = self.publisher.publishes.get(rid)
        given_up = self._given_up.take(rid, entry.reader_engine if entry is not None else "")
        if given_up is not None and not self.offers.get(rid):
            self.publisher.release_unwanted(rid, given_up)
            return
        for reader, rank, _at in self._landed_early.pop(rid, ()):
            try:
                self.publisher.admit_writer(rid, reader, rank)
            except KvxferError:
                continue  # bound to another reader meanwhile: its lease or its reader frees it
            self.publisher.reader_finished(rid, reader.engine_id, rank, None)
        waiting = [o for o in self.offers.get(rid, {}).values() if o.task is None]
        if waiting:
            reg = self.registry.require()
            for offer in waiting:
                self._start(offer, reg)

    def publish_dropped(self, rid: str, why: str) -> None:
        """The publish of ``rid`` is gone: its offers fail (a WRITE in flight is cancelled first)."""
        for offer in list(self.offers.get(rid, {}).values()):
            err = AbortedError(f"push of {rid!r} stopped: the publish was dropped ({why})", field="request_id")
            if offer.task is not None and not offer.task.done():
                offer.task.cancel(err.message)
            else:
                self._fail(offer, err)

    async def worker_gone(self, why: str) -> None:
        """The worker exited: what it did not publish yet it never will, so every offer still waiting fails.

        Offers of requests it did publish end with their publish (:meth:`publish_dropped`); their
        push tasks, cancelled then, are waited for too. The
        layer WRITEs an offer already streamed are stopped and waited for before its reader hears
        of the failure, so the reader's blocks are quiet when it frees them; and they must be, as
        the worker's memory is deregistered right after.
        """
        running: list[asyncio.Task[None]] = []
        for per_reader in list(self.offers.values()):
            for offer in list(per_reader.values()):
                if offer.task is None:
                    running += self._fail(offer, AbortedError(
                        f"request_id: the push of {offer.request_id!r} stopped before it was published: {why}",
                        field="request_id"))  # fmt: skip
                elif not offer.task.done():  # cancelled with its publish: its WRITE returns once fenced
                    running.append(offer.task)
        if running:
            await asyncio.wait(running)

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Stop every push (shutdown); returns the tasks to wait for. Every reader hears ABORTED."""
        self._given_up.close()
        self._abandoned.close()
        tasks = []
        for per_reader in list(self.offers.values()):
            for offer in list(per_reader.values()):
                if offer.task is None:  # not published yet: nothing of it will be
                    tasks += self._fail(offer, AbortedError(
                        f"request_id: the push of {offer.request_id!r} stopped: the sidecar is stopping",
                        field="request_id"))  # fmt: skip
                    continue
                self._forget(offer)
                tasks += offer.cancel_streams()
                if not offer.task.done():
                    offer.task.cancel("the sidecar is stopping")  # its end tells the reader
                    tasks.append(offer.task)
        return tasks

    # ------------------------------------------------------------------ one push
    def _start(self, offer: Offer, reg: Registration) -> None:
        offer.task = asyncio.get_running_loop().create_task(self._push(offer, reg))
        offer.task.add_done_callback(lambda task: self._never_ran(offer, task))

    def _never_ran(self, offer: Offer, task: asyncio.Task[None]) -> None:
        """A push cancelled before its task's first step (its publish dropped, the sidecar stopping, in
        the same loop turn as the publish): ``_push`` catches every way it ends, so only then does its
        task end cancelled, having told the reader nothing. A revoked offer's reader asked: it knows."""
        if not task.cancelled() or offer.revoked:
            return
        try:
            task.result()
        except asyncio.CancelledError as exc:  # carries the canceller's reason, if it gave one
            why = str(exc.args[0]) if exc.args else f"push of {offer.request_id!r} stopped before it began"
        self._fail(offer, AbortedError(why, field="request_id"))

    async def _push(self, offer: Offer, reg: Registration) -> None:
        rid = offer.request_id
        with log_context(request_id=rid, transfer_id=offer.transfer_id, peer=offer.reader.label):
            started = time.monotonic()
            outcome: KvxferError | None = None
            moved = (0, 0, 0.0)
            try:
                async with asyncio.timeout(max(offer.deadline - started, 0.0)):
                    moved = await self._write(offer, reg)
            except TimeoutError:
                outcome = DeadlineError(f"push of {rid!r} into {offer.reader.label} did not finish by the offer's "
                                        "deadline", field="timeout_seconds")  # fmt: skip
            except asyncio.CancelledError as exc:
                if offer.revoked:
                    self.metrics.transfer_done("write", "aborted", nbytes=0, descriptors=0,
                                               seconds=time.monotonic() - started, reason="aborted")  # fmt: skip
                    return  # the reader knows: it asked
                outcome = AbortedError(str(exc.args[0]) if exc.args else f"push of {rid!r} stopped", field="request_id")
            except KvxferError as exc:
                outcome = exc
            except Exception as exc:  # a bug: the reader still gets its answer
                log.exception("push failed unexpectedly")
                outcome = KvxferError(f"internal error in push of {rid!r}: {type(exc).__name__}: {exc}")
            self._forget(offer)
            if offer.unfenced and outcome is None:
                # Written in full, but a layer's WRITE that failed earlier may still land, after the reader
                # has put the blocks to use: not reported as moved.
                outcome = PeerUnavailableError(f"push of {rid!r} into {offer.reader.label}: written, but a layer "
                                               "WRITE of it that failed earlier", field="remote_addresses")  # fmt: skip
            if offer.unfenced and outcome is not None:
                # A WRITE of it (this one, or a layer's) may still land: the reader must not reuse its blocks.
                amend_unfenced(outcome)
            elapsed = time.monotonic() - started
            if outcome is None:
                nbytes, ndesc, _ = moved
                self.metrics.transfer_done("write", "ok", nbytes=nbytes, descriptors=ndesc, seconds=elapsed)
                log.debug("push done", extra={"bytes": nbytes, "descriptors": ndesc, "seconds": round(elapsed, 6)})
            else:
                label = "timeout" if isinstance(outcome, DeadlineError) else "failed"
                self.metrics.transfer_done("write", label, nbytes=0, descriptors=0, seconds=elapsed,  # type: ignore[arg-type]
                                           reason=label if label == "timeout" else outcome.status.lower())  # fmt: skip
                log.info("push ended", extra={"outcome": label, "error": outcome.message})
            self.publisher.reader_finished(rid, offer.key[0], offer.rank, outcome.message if outcome else None)
            self.notices.send(offer, outcome, moved)

    async def _write(self, offer: Offer, reg: Registration) -> tuple[int, int, float]:
        """Plan this rank's part of the reader's pull and WRITE it; (bytes, descriptors, seconds).

        Groups the layer-wise stream already wrote completely are not written again.
        """
        entry = self.publisher.admit_writer(offer.request_id, offer.reader, offer.rank)
        streams = [t for t in offer.stream_tasks.values() if not t.done()]
        if streams:  # the last layers' WRITEs: a group they leave short is written whole after them
            await asyncio.gather(*streams, return_exceptions=True)
        skip = {n for n, g in reg.groups.items() if offer.covered(n, g.layout.num_layers)}
        local, remote = offer_rows(self.topologies, offer, reg, entry.blocks, entry.origins, skip)
        t0 = time.monotonic()
        if local.shape[0]:
            await self.write_rows(offer, local, remote)
        return (int(local[:, 1].sum()) + offer.stream_bytes, int(local.shape[0]) + offer.stream_descriptors,
                time.monotonic() - t0 + offer.stream_seconds)  # fmt: skip

    async def write_rows(self, offer: Offer, local: U64, remote: U64) -> None:
        """WRITE these rows of this side into the reader's (its registration must be the offered one)."""
        current = self.publisher.readers.ranks.get(offer.key)
        if current is None or current.epoch != offer.reader.epoch:
            raise PeerUnavailableError(
                f"reader {offer.reader.label} registered again or restarted since its offer of {offer.request_id!r}; "
                "its blocks are no longer the offered ones",
                field="epoch", reason=Reason.PEER_CHANGED,
            )  # fmt: skip
        reg = self.registry.require()
        peer = self._loaded.name(offer.reader, self.publisher.readers.ranks, self.offers)
        mem = mem_type(next(iter(reg.groups.values())).memory.mem_type)
        rmem = mem_type(next(iter(offer.reader.regions.values()))[1])
        offer.wrote = True
        try:
            await self.dp.transfer("WRITE", local, remote, peer, timeout=max(offer.deadline - time.monotonic(), 0.001),
                                   mem_type=mem, remote_mem_type=rmem)  # fmt: skip
        except asyncio.CancelledError as exc:
            if cancelled_unfenced(exc):
                offer.unfenced = True  # the push's answer (Landed, Revoke) says so
            raise
        except KvxferError as exc:
            self._loaded.unload(offer.key)
            unfenced = exc.reason == Reason.DATA_PLANE_UNFENCED  # the WRITE may still land in the reader's blocks
            offer.unfenced = offer.unfenced or unfenced
            raise PeerUnavailableError(
                f"data plane WRITE into {offer.reader.label} at {offer.reader.address} failed"
                f"{' and may still land' if unfenced else ''}: {exc.message}",
                field="remote_addresses", reason=Reason.DATA_PLANE_UNFENCED if unfenced else Reason.DATA_PLANE,
            ) from None  # fmt: skip

    def rank_rows(
        self, offer: Offer, reg: Registration, group: str, reader_ids: I64, writer_ids: I64, *,
        num_tokens: int | None, reader_skip: int, writer_skip: int,
    ) -> tuple[U64, U64, I64]:  # fmt: skip
        """The reader's pull plan of ``group`` restricted to this rank: (this side's rows, the reader's rows,
        this side's region of each row). Raises the topology's error for lists that do not fit."""
        return group_rows(self.topologies, offer, reg, group, reader_ids, writer_ids, num_tokens=num_tokens,
                          reader_skip=reader_skip, writer_skip=writer_skip)  # fmt: skip

    def landed_early(self, offer: Offer) -> None:
        """The layer-wise stream wrote every byte of ``offer`` before the publish: tell the reader now."""
        if offer.task is not None or self.offers.get(offer.request_id, {}).get(offer.key) is not offer:
            return  # the publish path has it, or it ended otherwise
        self._forget(offer)
        now = time.monotonic()
        horizon = now - self.settings.transfer_timeout_seconds - self.settings.lease_seconds
        for rid in [r for r, done in self._landed_early.items() if all(at < horizon for *_x, at in done)]:
            del self._landed_early[rid]
        self._landed_early.setdefault(offer.request_id, []).append((offer.reader, offer.rank, now))
        self.metrics.transfer_done("write", "ok", nbytes=offer.stream_bytes, descriptors=offer.stream_descriptors,
                                   seconds=offer.stream_seconds)  # fmt: skip
        self.notices.send(offer, None, (offer.stream_bytes, offer.stream_descriptors, offer.stream_seconds))

    def _lapse(self, offer: Offer) -> None:
        """The offer's deadline passed before its publish came: the reader is told (its own deadline ends it)."""
        if offer.task is None and self.offers.get(offer.request_id, {}).get(offer.key) is offer:
            self._fail(offer, DeadlineError(
                f"request_id: {offer.request_id!r} was not published on {self.settings.engine_id} before the offer's "
                "deadline", field="request_id"))  # fmt: skip
            if not self.offers.get(offer.request_id):  # its reader gives up at this deadline too
                self._given_up.remember(offer.request_id, offer.key[0], f"{offer.key[0]} gave up on it before it "
                                        "was published (its offer lapsed)")  # fmt: skip

    def _fail(self, offer: Offer, err: KvxferError) -> list[asyncio.Task[None]]:
        """End an offer with no push task (or one that never ran): stop its layer WRITEs, then tell the reader.

        A failed ``Landed`` lets the reader reuse its blocks, so it must not leave while a WRITE of
        the offer may still land (a device copy drains before its task ends), nor may a ``Revoke``
        of it be answered before. Returns the WRITEs still stopping.
        """
        self._forget(offer)
        running = offer.cancel_streams()
        if not running:
            self.notices.send(offer, err)
            return running

        stopping = (offer.request_id, offer.key)
        self._stopping[stopping] = (offer, running)

        async def when_stopped() -> None:
            try:
                await asyncio.wait(running)
            finally:
                self._stopping.pop(stopping, None)
            if offer.unfenced:  # a layer WRITE of it may still land
                amend_unfenced(err)
            self.notices.send(offer, err)

        self.outbox.spawn(when_stopped())
        return running

    def _forget(self, offer: Offer) -> None:
        per_reader = self.offers.get(offer.request_id)
        if per_reader is not None and per_reader.get(offer.key) is offer:
            del per_reader[offer.key]
            if not per_reader:
                del self.offers[offer.request_id]
        if offer.timer is not None:
            offer.timer.cancel()
