"""The decode side: the pulls in flight, from admission to the outcome.

A Pull is validated and admitted (one per request id), runs as a task under its deadline through
the steps of :mod:`kvxfer.server.pull_steps`, and ends in exactly one outcome: done, failed,
timed out or aborted. Every outcome is reported the same way: a completion event, metrics, the
waiting Pull call, and a notice to the publishers so they free their blocks at once. Every
failure carries a status code, a reason and a message naming the field or peer
(:mod:`kvxfer.server.pull_failures`); other pulls are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer.config import Settings
from kvxfer.errors import (
    AbortedError,
    AlreadyExistsError,
    InvalidArgumentError,
    KvxferError,
    NotFoundError,
    Reason,
)
from kvxfer.logs import get_logger, log_context
from kvxfer.metrics import PULL_PATHS, SidecarMetrics
from kvxfer.server.events import CompletionHub, Kind
from kvxfer.server.outbox import Outbox
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.prepared import PreparedPull, PreparedPulls, plan_key
from kvxfer.server.publisher import MAX_BATCH
from kvxfer.server.pull_failures import metric_reason, pull_failure, unfenced_behind
from kvxfer.server.pull_steps import PullSteps
from kvxfer.server.push_steps import landed_matches
from kvxfer.server.registration import Registry
from kvxfer.server.state import Due, Grant, PullEntry, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.unsettled import UnsettledPulls
from kvxfer.server.validation import check_addresses, check_timeout, remote_blocks, token_spans
from kvxfer.transport import Transport
from kvxfer.wire import local_pb2, peer_pb2
from kvxfer.wire.convert import blocks_from_proto, check_id
from kvxfer.wire.status import code_of

__all__ = ["Puller"]

log = get_logger("kvxfer.server")
#: Ended pulls whose request ids are remembered (see Puller._ended).
ENDED_KEPT = 4096
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
#: Ends a request's holds as its pull starts: (grants, answers due) by address (kvxfer.server.holds.Holds.take).
TakeHolds = Callable[[str], tuple[dict[str, Grant], dict[str, Due]]]


class Puller:
    """Owns the pulls in flight (see the module docs)."""

    def __init__(
        self, settings: Settings, registry: Registry, data_plane: Transport, peers: PeerDirectory, outbox: Outbox,
        hub: CompletionHub, metrics: SidecarMetrics, topologies: TopologyCache,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.registry = registry
        self.peers = peers
        self.outbox = outbox
        self.hub = hub
        self.metrics = metrics
        paths = {path: self.metrics.pull_paths.labels(path=path) for path in PULL_PATHS}
        self.steps = PullSteps(
            registry, data_plane, peers, outbox, topologies, on_plan=self._planned, on_path=lambda p: paths[p].inc()
        )
        self.pulls: dict[str, PullEntry] = {}
        #: Pulls that failed while a READ of them was still in flight (GetStatus.unsettled).
        self.unsettled = UnsettledPulls(settings.unfenced_hold_seconds, data_plane.unfenced_live)
        #: Plans of Pulls to come (Prepare), by request id.
        self.prepared = PreparedPulls()
        #: The request ids of the last pulls that ended, oldest first: a Prepare that comes after its
        #: Pull (it raced it over another connection) is not kept.
        self._ended: dict[str, None] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ local API
    async def pull(
        self, req: local_pb2.PullRequest, client_timeout: float | None, take: TakeHolds | None = None, *,
        gathers: bool = True,
    ) -> local_pb2.PullResponse:  # fmt: skip
        """Validate, start the transfer, and answer when posted (or done, with ``wait``).

        ``take``: ends the holds of the request once its pull is admitted (:meth:`kvxfer.server.holds.Holds.take`),
        giving the publishers' promises (grants) by address, and the answers still due to its first
        Holds (the pull waits for them); a Pull refused for its input ends nothing.
        ``gathers``: whether ``worker_gather`` may be honoured (not within a PullBatch, whose client
        runs no gathers; and only for a pull the worker waits for).
        """
        entered = time.monotonic()
        entry = self._start(req, client_timeout, take)
        entry.waited = req.wait
        wait_for = entry.done if req.wait else asyncio.ensure_future(_first(entry.posted, entry.done))
        if gathers and req.worker_gather and req.wait and not req.push:
            entry.handoff = asyncio.get_running_loop().create_future()
        try:
            if entry.handoff is None:
                await asyncio.shield(wait_for)
            else:  # whichever comes first: the gather to hand out, or the outcome
                # One future for both, not asyncio.wait: the gather's answer leaves a loop turn earlier.
                entry.done.add_done_callback(partial(_settle, entry.handoff))
                await entry.handoff
        except asyncio.CancelledError:
            # The worker gave up on a waiting Pull (cancelled or its deadline passed): abort it.
            if req.wait and entry.task is not None and not entry.task.done():
                entry.abort_reason = "the worker cancelled its Pull call"
                entry.task.cancel()
            self._book(entry)  # it may have succeeded just before: nobody else does its bookkeeping
            raise
        if entry.handoff is not None and entry.handoff.done() and not entry.done.done():
            # The worker moves the bytes and reports with GatherDone; this pull's bookkeeping is _run's.
            entry.waited = False
            resp = local_pb2.PullResponse(transfer_id=entry.transfer_id, request_id=entry.request_id,
                                          gather=entry.handoff.result())  # fmt: skip
        else:
            resp = self._answer(entry)
            if req.wait:
                # Runs once this task step has returned the answer (the fast socket writes it in the
                # same step): the bookkeeping stays off the worker's critical path.
                asyncio.get_running_loop().call_soon(self._book, entry)
        if log.isEnabledFor(logging.DEBUG):  # where a pull's time goes, on monotonic clocks every process shares
            log.debug("pull answered", extra={"entered": entered, "started": entry.started,
                                              "answering": time.monotonic()})  # fmt: skip
        return resp

    def started(self, rid: str) -> bool:
        """Whether a pull of ``rid`` is in flight or among the last :data:`ENDED_KEPT` that ended."""
        return rid in self.pulls or rid in self._ended

    async def gather_done(self, req: local_pb2.GatherDoneRequest) -> local_pb2.PullResponse:
        """A worker's report on the gather it was handed: the pull's outcome, once the pull has ended."""
        entry = self.steps.worker.waiting.get(req.ticket)
        if entry is None or entry.gathered is None:
            raise NotFoundError(
                f"ticket: no pull waits for gather {req.ticket} (it ended: timed out, aborted or reported)",
                field="ticket", reason=Reason.UNKNOWN_TICKET,
            )  # fmt: skip
        if not entry.gathered.done():
            entry.gathered.set_result(req)
        await asyncio.wait((entry.done,))  # _run books the outcome
        return self._answer(entry)

    @staticmethod
    def _answer(entry: PullEntry) -> local_pb2.PullResponse:
        """The Pull answer for ``entry`` as it stands (raises its failure, if it failed)."""
        failure = entry.done.exception() if entry.done.done() else None
        if failure is not None:
            raise failure
        resp = local_pb2.PullResponse(transfer_id=entry.transfer_id, request_id=entry.request_id,
                                      done=entry.done.done())  # fmt: skip
        if entry.done.done():
            resp.stats.CopyFrom(entry.done.result())
        return resp

    def _start(self, req: local_pb2.PullRequest, client_timeout: float | None, take: TakeHolds | None) -> PullEntry:
        reg = self.registry.require()
        rid = check_id(req.request_id, "request_id")
        if rid in self.pulls:
            raise AlreadyExistsError(f"request_id: a pull of {rid!r} is already in flight", field="request_id")
        plan = None
        if rid in self.prepared:
            # Checked before the plan is taken: a Pull refused here leaves it to the corrected one.
            timeout = self._timeout(req, client_timeout)
            plan = self.prepared.take(rid, plan_key(req))
            if plan is None or plan.epoch != reg.epoch:
                plan = None
                self._planned("replanned")
        if plan is None:
            entry, local_blocks, remote_given, timeout = self._parse(req, reg, client_timeout)
        else:  # the Prepare checked these very fields
            entry = self._entry(req, list(req.remote_addresses), timeout)
            local_blocks, remote_given = dict(plan.local_blocks), dict(plan.remote_given)
            entry.prepared = plan
        if take is not None:  # admitted: its holds end here, and their promises are the pull's
            entry.grants, entry.grants_due = take(rid)
        if req.push:
            entry.offer = (list(req.local_blocks), list(req.remote_blocks))
        self.pulls[rid] = entry
        entry.task = asyncio.get_running_loop().create_task(self._run(entry, reg, local_blocks, remote_given, timeout))
        entry.task.add_done_callback(lambda task: self._never_ran(entry, task))
        return entry

    def _parse(
        self, req: local_pb2.PullRequest, reg: Registration, client_timeout: float | None
    ) -> tuple[PullEntry, dict[str, I64], dict[str, I64], float]:
        """Check a Pull's fields (raising an error that names the field): its entry, block ids and seconds."""
        if req.remote_engine_id:
            check_id(req.remote_engine_id, "remote_engine_id")
        if not req.remote_addresses:
            raise InvalidArgumentError(
                "remote_addresses: give the peer API address of every remote TP rank's sidecar, in rank order",
                field="remote_addresses",
            )
        addresses = check_addresses(req.remote_addresses)
        local_blocks = blocks_from_proto(req.local_blocks, reg.layouts, "local_blocks")
        remote_given = remote_blocks(req.remote_blocks, reg.layouts, push=req.push)
        timeout = self._timeout(req, client_timeout)
        return self._entry(req, addresses, timeout), local_blocks, remote_given, timeout

    def _timeout(self, req: local_pb2.PullRequest, client_timeout: float | None) -> float:
        limit = self.settings.transfer_timeout_seconds
        timeout = min(check_timeout(float(req.timeout_seconds)) or limit, limit)
        if client_timeout is not None:
            timeout = min(timeout, max(client_timeout - 0.05, 0.01))
        return timeout

    def _entry(self, req: local_pb2.PullRequest, addresses: list[str], timeout: float) -> PullEntry:
        now = time.monotonic()
        return PullEntry(
            f"{self.registry.instance_id[:8]}-{next(self._ids)}", req.request_id, req.remote_engine_id, addresses,
            now + timeout, now, spans=token_spans(req.local_blocks, req.remote_blocks), push=req.push,
        )  # fmt: skip

    async def prepare(self, req: local_pb2.PrepareRequest, client_timeout: float | None) -> local_pb2.PrepareResponse:
        """Check the Pull to come and plan its READs now (kvxfer.server.prepared); moves and holds nothing."""
        pull = req.pull
        rid = check_id(pull.request_id, "pull.request_id")
        # The scheduler's Prepare and the worker's Pull may arrive together (a step with little else
        # to do): planning ahead must never hold up the Pull. A Pull that came first, or that is
        # ready to run now, goes first (one loop turn), and this Prepare stops without its checks.
        started = local_pb2.PrepareResponse(why_not=f"request_id: the pull of {rid!r} has started")
        if self.started(rid):
            return started
        await asyncio.sleep(0)
        if self.started(rid):
            return started
        reg = self.registry.require()
        entry, local_blocks, remote_given, _ = self._parse(pull, reg, client_timeout)
        key = plan_key(pull)
        with log_context(request_id=rid, peer=_peer_label(entry)):
            got = await self.steps.prepare(entry, reg, local_blocks, remote_given)
            if isinstance(got, str):
                log.debug("pull not prepared", extra={"why": got})
                return local_pb2.PrepareResponse(why_not=got)
            if self.started(rid) or reg is not self.registry.registration:
                return local_pb2.PrepareResponse(why_not="the pull started, or this worker registered again, meanwhile")
            sessions, per_rank, warnings = got
            self.prepared.put(rid, PreparedPull(
                key, reg.epoch, local_blocks, remote_given, sessions, per_rank, tuple(warnings),
                time.monotonic() + self.settings.max_hold_seconds,
            ))  # fmt: skip
        self._planned("prepared")
        return local_pb2.PrepareResponse(prepared=True)

    def _planned(self, outcome: str) -> None:
        self.metrics.prepared_pulls.labels(outcome=outcome).inc()

    async def pull_batch(
        self, req: local_pb2.PullBatchRequest, client_timeout: float | None,
        take: TakeHolds | None = None,
    ) -> local_pb2.PullBatchResponse:  # fmt: skip
        """Every pull runs as if it came alone; each gets its own result, in order."""
        n = len(req.pulls)
        if not 1 <= n <= MAX_BATCH:
            raise InvalidArgumentError(f"pulls: {n} pulls in one PullBatch; give 1 to {MAX_BATCH}", field="pulls")

        async def one(p: local_pb2.PullRequest) -> local_pb2.PullResult:
            with log_context(request_id=p.request_id or None, peer=p.remote_engine_id or None):
                try:
                    return local_pb2.PullResult(response=await self.pull(p, client_timeout, take, gathers=False))
                except KvxferError as exc:
                    return local_pb2.PullResult(code=code_of(exc).value[0], message=exc.message,
                                                reason=exc.reason.value, field=exc.field or "")  # fmt: skip
                except Exception as exc:  # a bug: answer it for this pull, keep the others
                    log.exception("pull failed unexpectedly")
                    return local_pb2.PullResult(
                        code=grpc.StatusCode.INTERNAL.value[0], message=f"internal error: {type(exc).__name__}: {exc}",
                        reason=Reason.INTERNAL.value,
                    )  # fmt: skip

        # Tasks start in order and each registers its request id before its first await, so a
        # repeated id within the batch is refused (ALREADY_EXISTS) like a second Pull would be.
        return local_pb2.PullBatchResponse(results=await asyncio.gather(*(one(p) for p in req.pulls)))

    async def abort(self, rid: str, reason: str) -> bool:
        """Stop a pull of ``rid``; False when none was running."""
        pull = self.pulls.get(rid)
        if pull is None or pull.task is None or pull.task.done():
            return False
        pull.abort_reason = reason
        pull.task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(pull.done), timeout=5.0)
        return True

    def landed(self, req: peer_pb2.LandedRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.LandedResponse:
        """A writer's WRITEs of a push ended: hand its notice to the pull that offered to it."""
        rid = check_id(req.request_id, "request_id")
        creds.check(req.engine_id, "engine_id")
        entry = self.pulls.get(rid)
        reg = self.registry.registration
        if entry is None or not entry.push or reg is None or req.epoch != reg.epoch:
            return peer_pb2.LandedResponse(found=False)  # given up on, or written into an older registration
        for address, fut in entry.landed.items():
            if not fut.done() and landed_matches(entry.writers.get(address), req):
                fut.set_result(req)
                return peer_pb2.LandedResponse(found=True)
        return peer_pb2.LandedResponse(found=False)

    def peer_abort(self, rid: str, publishers: set[str], reason: str) -> bool:
        """A publisher aborted ``rid``: cancel our pull of it if it reads from that publisher."""
        pull = self.pulls.get(rid)
        if pull is None or pull.task is None or pull.task.done() or publishers.isdisjoint(pull.addresses):
            return False
        pull.abort_reason, pull.abort_from_peer = reason, True
        pull.task.cancel()
        return True

    async def cancel_all(self, reason: str, wait: float) -> int:
        """Cancel every pull in flight (drain ran out, shutdown); returns how many."""
        pulls = list(self.pulls.values())
        for p in pulls:
            if p.task is not None:
                p.abort_reason = reason
                p.task.cancel()
        for p in pulls:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(p.done), timeout=wait)
        return len(pulls)

    # ------------------------------------------------------------------ one pull
    async def _run(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64],
        budget: float,
    ) -> None:  # fmt: skip
        sessions: dict[int, PeerSession] = {}
        with log_context(request_id=entry.request_id, transfer_id=entry.transfer_id, peer=_peer_label(entry)):
            failure: tuple[KvxferError, str] | None = None
            try:
                async with asyncio.timeout(budget):
                    stats = await self.steps.run(entry, reg, local_blocks, remote_given, sessions)
                if behind := self.unsettled.in_flight(entry.unfenced_ops):
                    raise unfenced_behind(entry, behind)
            except (Exception, asyncio.CancelledError) as exc:  # every way a pull ends is reported below
                failure = pull_failure(entry, exc, budget, sessions, self.peers)
            finally:
                self.pulls.pop(entry.request_id, None)
                self._ended[entry.request_id] = None
                if len(self._ended) > ENDED_KEPT:
                    del self._ended[next(iter(self._ended))]
            if failure is not None:
                self._failed(entry, *failure)
                return
            entry.unbooked = (stats, time.monotonic() - entry.started)
            if not entry.done.done():
                entry.done.set_result(stats)
            if not entry.waited:  # else the waiting Pull call books it once it has answered
                asyncio.get_running_loop().call_soon(self._book, entry)

    def _never_ran(self, entry: PullEntry, task: asyncio.Task[None]) -> None:
        """A pull aborted before its task's first step: report it, which its body never got to do.

        ``_run`` catches every way it can end, so its task ends cancelled only when the cancel came
        before it started (an Abort in the same loop turn as the Pull): then none of its code ran,
        and the waiting Pull, the metrics, the event and the publishers would hear nothing until
        the worker's own deadline.
        """
        if not task.cancelled():
            return
        if self.pulls.get(entry.request_id) is entry:
            del self.pulls[entry.request_id]
        with log_context(request_id=entry.request_id, transfer_id=entry.transfer_id, peer=_peer_label(entry)):
            why = entry.abort_reason or "the sidecar is shutting down"
            self._failed(entry, AbortedError(f"pull of {entry.request_id!r} aborted: {why}", field="request_id"),
                         "aborted")  # fmt: skip

    def _failed(self, entry: PullEntry, err: KvxferError, outcome: str) -> None:
        """Report a failed pull: metrics, event, the publishers, and the waiting Pull call."""
        elapsed = time.monotonic() - entry.started
        self.metrics.transfer_done("push" if entry.push else "read", outcome, nbytes=0, descriptors=0, seconds=elapsed,  # type: ignore[arg-type]
                                   reason=metric_reason(err, outcome))  # fmt: skip
        kind = Kind.ABORTED if outcome == "aborted" else Kind.PULL_FAILED
        self.hub.emit(kind, entry.request_id, transfer_id=entry.transfer_id, code=code_of(err).value[0],
                      message=err.message, peer=entry.remote_engine_id)  # fmt: skip
        log.info("pull ended", extra={"outcome": outcome, "error": err.message})
        if err.reason == Reason.DATA_PLANE_UNFENCED:
            self.unsettled.add(entry.request_id, entry.unfenced_ops)  # the worker keeps the blocks meanwhile
        reg = self.registry.registration
        if outcome == "aborted" and not entry.abort_from_peer:
            self.outbox.abort_publishers(entry, err.message)
        elif reg is not None:
            if outcome == "aborted":
                entry.contacted.clear()  # only the unread replicas are told
            elif outcome == "failed" and not entry.posted.done():
                # Nothing was read: the mistake (block counts, ids not published, a layout or peer
                # that does not fit) is the caller's or this side's, so the publish stays as it was
                # and a corrected retry finds it. Only a data-plane failure, a timeout or an abort
                # tells the publisher FAILED.
                entry.contacted.clear()
            self.outbox.notify_publishers(entry, reg.rank, "failed", err.message, 0)
        for fut in (entry.posted, entry.done):
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: a non-waiting Pull never awaits it

    def _book(self, entry: PullEntry) -> None:
        """The bookkeeping of a successful pull, once (nothing for a pull not done or failed)."""
        if entry.unbooked is not None:
            (stats, elapsed), entry.unbooked = entry.unbooked, None
            with log_context(request_id=entry.request_id, transfer_id=entry.transfer_id, peer=_peer_label(entry)):
                self._pulled(entry, stats, elapsed)

    def _pulled(self, entry: PullEntry, stats: local_pb2.TransferStats, elapsed: float) -> None:
        self.metrics.transfer_done(
            "push" if entry.push else "read", "ok", nbytes=stats.bytes, descriptors=stats.descriptors, seconds=elapsed
        )
        self.hub.emit(
            Kind.PULLED, entry.request_id, transfer_id=entry.transfer_id, peer=entry.remote_engine_id, stats=stats
        )
        log.debug("pull done", extra={"bytes": stats.bytes, "descriptors": stats.descriptors,
                                      "seconds": round(elapsed, 6)})  # fmt: skip
        reg = self.registry.registration
        if reg is not None:
            self.outbox.notify_publishers(entry, reg.rank, "done", "", stats.bytes)


def _peer_label(entry: PullEntry) -> str:
    """Who a pull's logs name as its peer: the remote engine, else the addresses it reads from."""
    return entry.remote_engine_id or ",".join(entry.addresses)


async def _first(a: asyncio.Future[Any], b: asyncio.Future[Any]) -> None:
    await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)


def _settle(handoff: asyncio.Future[Any], _done: object) -> None:
    """The pull ended before a gather was handed out: wake its Pull call with no gather."""
    if not handoff.done():
        handoff.set_result(None)
