"""The sidecar's logic, independent of how requests arrive: a thin composition of its parts.

* :class:`~kvxfer.server.registration.Registry`: the worker's registration and this sidecar's identity;
* :class:`~kvxfer.server.publisher.Publisher`: the prefill side (publishes, leases) and the peer API it serves;
* :class:`~kvxfer.server.puller.Puller`: the decode side (pulls in flight and their outcomes), running
  each pull through :class:`~kvxfer.server.pull_steps.PullSteps`;
* :class:`~kvxfer.server.outbox.Outbox`: what this sidecar owes its peers (lookups, notices, aborts);
* :class:`~kvxfer.server.peers.PeerDirectory`: handshaken sessions to the publishers it reads from.

:class:`SidecarCore` routes each RPC to its owner, and owns what spans them: the role and
draining checks, the local ``Abort`` (publish and pull), the completion stream, drain and shutdown.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvxfer import PROTOCOL_VERSION
from kvxfer.config import Settings
from kvxfer.errors import FailedPreconditionError, InvalidArgumentError, KvxferError, Reason, UnavailableError
from kvxfer.logs import get_logger
from kvxfer.memory import FdLookup
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.events import CompletionHub
from kvxfer.server.holds import Holds
from kvxfer.server.identity import Identity
from kvxfer.server.outbox import Outbox
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.server.peer_frames import FramesDialer
from kvxfer.server.peers import PeerDirectory
from kvxfer.server.publisher import MAX_BATCH, Publisher
from kvxfer.server.puller import Puller
from kvxfer.server.pusher import Pusher
from kvxfer.server.registration import Registry
from kvxfer.server.streamer import Streamer
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import check_addresses, check_drain_timeout
from kvxfer.transport import Transport
from kvxfer.transport.worker_agent import WorkerAgentTransport
from kvxfer.wire import common_pb2, local_pb2, peer_pb2
from kvxfer.wire.convert import check_id, rank_to_proto

__all__ = ["SidecarCore"]

log = get_logger("kvxfer.server")

#: The longest AgentJobs long poll (under the local API's default call limit of 30 s).
MAX_AGENT_WAIT_S = 10.0


class SidecarCore:
    """All state and behaviour of one sidecar, by part (see the module docs)."""

    def __init__(
        self,
        settings: Settings,
        data_plane: Transport,
        metrics: SidecarMetrics,
        *,
        peer_address: str,
        channel_options: list[tuple[str, Any]],
        channel_credentials: grpc.ChannelCredentials | None,
        on_serving: Callable[[bool], None] = lambda _s: None,
        fd_lookup: FdLookup | None = None,
    ) -> None:
        self.settings = settings
        self.dp = data_plane
        self.metrics = metrics
        self.peer_address = peer_address
        self.instance_id = uuid.uuid4().hex
        self.hub = CompletionHub()
        self.draining = False
        self.drain_done = asyncio.Event()  # set once a drain has finished
        self._on_serving = on_serving
        self._drained: asyncio.Future[local_pb2.DrainResponse] | None = None  # the drain, once started
        self.registry = Registry(settings, data_plane, metrics, instance_id=self.instance_id,
                                 peer_address=peer_address, fd_lookup=fd_lookup)  # fmt: skip
        token = settings.token()
        md = (("authorization", f"Bearer {token}"),) if token else ()
        self.peers = PeerDirectory(
            me=self.registry.identity, load_peer=data_plane.add_peer, forget_peer=data_plane.remove_peer,
            channel_options=channel_options, credentials=channel_credentials, metadata=md,
            on_handshake=lambda outcome: self.metrics.handshakes.labels(outcome=outcome).inc(),
            frames=FramesDialer.of(settings), longest_transfer=settings.transfer_timeout_seconds,
        )  # fmt: skip
        self.topologies = TopologyCache()
        self.outbox = Outbox(self.peers, engine_id=settings.engine_id, instance_id=self.instance_id)
        self.publisher = Publisher(settings, self.registry, self.hub, metrics, self.outbox, self.topologies)
        self.puller = Puller(settings, self.registry, data_plane, self.peers, self.outbox, self.hub, metrics,
                             self.topologies)  # fmt: skip
        self.pusher = Pusher(settings, self.registry, data_plane, self.publisher, self.peers, self.outbox, metrics,
                             self.topologies)  # fmt: skip
        self.publisher.on_dropped = self.pusher.publish_dropped
        self.streamer = Streamer(self.registry, self.pusher)
        self.holds = Holds(settings, self.peers, me=self._hold_identity)
        # Gauges of the current state are read at scrape time: nothing to update on the hot path.
        metrics.leases_active.set_function(lambda: len(self.publisher.publishes))
        metrics.in_flight.set_function(lambda: len(self.puller.pulls))
        metrics.unsettled.set_function(lambda: len(self.puller.unsettled))
        metrics.peers.set_function(lambda: len(self.peers) + self.publisher.count_readers())

    # ================================================================== shared checks
    def identity(self) -> Identity:
        """This sidecar as its handshake describes it (needs a registration)."""
        return self.registry.identity()

    def _hold_identity(self) -> tuple[str, str, common_pb2.Rank | None]:
        reg = self.registry.registration
        return self.settings.engine_id, self.instance_id, rank_to_proto(reg.rank) if reg is not None else None

    def _require_role(self, role: str, what: str) -> None:
        if self.settings.role not in (role, "both"):
            raise FailedPreconditionError(
                f"{what}: this sidecar runs with --role {self.settings.role}; {what} needs role {role} or both",
                field="role", reason=Reason.WRONG_ROLE,
            )  # fmt: skip

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise UnavailableError(f"{what}: the sidecar is draining and accepts no new work", field="draining")

    # ================================================================== local API
    async def register_caches(self, req: local_pb2.RegisterCachesRequest) -> local_pb2.RegisterCachesResponse:
        """RegisterCaches: attach the worker's memory and register it with the data plane."""
        self._refuse_if_draining("RegisterCaches")
        old = self.registry.registration
        if old is not None and old.leases and not any(map(self.registry.lease_open, old.leases)):
            await self.worker_gone(old.epoch)  # its lease closed a moment ago: do not wait for the notice
        publishes, pulls = len(self.publisher.publishes), len(self.puller.pulls)
        busy = f"{publishes} requests are published and {pulls} pulls are in flight" if publishes or pulls else ""
        resp = self.registry.register(req, busy=busy)
        self.topologies.clear()
        self.puller.prepared.clear()  # planned against the registration this one replaces
        if not self.draining:
            self._on_serving(True)
        return resp

    async def publish(self, req: local_pb2.PublishRequest) -> local_pb2.PublishResponse:
        """Publish: hold a request's blocks under a lease."""
        self._refuse_if_draining("Publish")
        self._require_role("prefill", "Publish")
        resp = self.publisher.publish(req)
        self.pusher.published(resp.request_id)
        return resp

    async def pull(self, req: local_pb2.PullRequest, client_timeout: float | None) -> local_pb2.PullResponse:
        """Pull: validate, start the transfer, and answer when posted (or done, with ``wait``)."""
        self._refuse_if_draining("Pull")
        self._require_role("decode", "Pull")
        return await self.puller.pull(req, client_timeout, self.holds.take)

    async def gather_done(self, req: local_pb2.GatherDoneRequest) -> local_pb2.PullResponse:
        """GatherDone: the worker's report on a pull it moved itself; answers the pull's outcome."""
        return await self.puller.gather_done(req)

    async def pull_batch(
        self, req: local_pb2.PullBatchRequest, client_timeout: float | None
    ) -> local_pb2.PullBatchResponse:
        """PullBatch: every pull runs as if it came alone; each gets its own result, in order."""
        self._refuse_if_draining("PullBatch")  # refused whole, as each of its pulls would be
        self._require_role("decode", "PullBatch")
        return await self.puller.pull_batch(req, client_timeout, self.holds.take)

    async def expect(self, req: local_pb2.ExpectRequest) -> local_pb2.ExpectResponse:
        """Expect: keep a queued request's publishes alive until its Pull starts (see kvxfer.server.holds)."""
        self._refuse_if_draining("Expect")
        self._require_role("decode", "Expect")
        rid = check_id(req.request_id, "request_id")
        if not req.remote_addresses:
            raise InvalidArgumentError(
                "remote_addresses: give the peer API address of every remote TP rank's sidecar, in rank order",
                field="remote_addresses",
            )
        addresses = check_addresses(req.remote_addresses)
        reg = self.registry.require()  # holding needs a handshake, which needs a registration
        if self.puller.started(rid):
            # An Expect that comes after its Pull (the scheduler's connection is not the worker's):
            # holding now would only keep the publish alive after the pull has freed it.
            return local_pb2.ExpectResponse(held=False)
        try:
            read = self.topologies.read_by_all(reg, len(addresses))
        except KvxferError:  # the ranks do not fit this layout: the pull says so; hold them all meanwhile
            read = set(range(len(addresses)))
        # Only the publishers some rank of this instance reads: a Hold makes this sidecar a reader
        # of that copy, which an unread replica (MLA latents, replicated heads) must not have, or it
        # would wait for a confirmation that never comes instead of being freed by its UNREAD notice.
        held = [a for q, a in enumerate(addresses) if q in read]
        return local_pb2.ExpectResponse(held=self.holds.expect(rid, held))

    async def prepare(self, req: local_pb2.PrepareRequest, client_timeout: float | None) -> local_pb2.PrepareResponse:
        """Prepare: check the Pull a worker is about to send and plan it now (see kvxfer.server.prepared)."""
        self._refuse_if_draining("Prepare")
        self._require_role("decode", "Prepare")
        try:
            return await self.puller.prepare(req, client_timeout)
        except KvxferError as exc:  # the same check as the Pull's, about the field inside PrepareRequest.pull
            if exc.field is None or exc.message.startswith("pull."):
                raise
            raise type(exc)(f"pull.{exc.message}", field=f"pull.{exc.field}", reason=exc.reason) from None

    async def release(self, req: local_pb2.ReleaseRequest) -> local_pb2.ReleaseResponse:
        """Release: drop a publish (the worker frees the blocks itself)."""
        rid = check_id(req.request_id, "request_id")
        return local_pb2.ReleaseResponse(released=self.publisher.release(rid))

    async def abort(self, req: local_pb2.AbortRequest) -> local_pb2.AbortResponse:
        """Abort: stop a request here and on its peers; frees blocks on both sides."""
        rid = check_id(req.request_id, "request_id")
        reason = req.reason or "aborted by the worker"
        addresses: list[str] = []
        if req.remote_addresses:  # checked before anything is stopped
            self._require_role("decode", "Abort with remote_addresses")
            addresses = check_addresses(req.remote_addresses)
        self.holds.discard(rid)
        self.puller.prepared.discard(rid)
        resp = local_pb2.AbortResponse()
        resp.aborted_publish = self.publisher.abort(rid, reason)
        if not resp.aborted_publish and self.settings.role in ("prefill", "both"):
            # Push mode: a request aborted before it was published here never will be; the offers
            # waiting for it fail now rather than at their deadline (a published one's fail with it).
            self.pusher.abandon(rid, reason)
        resp.aborted_pulls = int(await self.puller.abort(rid, reason))
        if addresses:
            reg = self.registry.registration
            rank = reg.rank if reg is not None else None  # a publisher that has not published it yet hears a Revoke
            dropped = await asyncio.gather(*(self.outbox.drop_remote(a, rid, reason, rank) for a in addresses))
            resp.remote_dropped = sum(dropped)
        return resp

    async def status(self, req: local_pb2.GetStatusRequest) -> local_pb2.StatusResponse:
        """GetStatus; with ``publishes``, which of those publishes this sidecar still holds, until when;
        with ``unsettled``, which of those failed pulls may still have bytes landing (kvxfer.server.unsettled)."""
        for name in ("publishes", "unsettled"):
            if len(getattr(req, name)) > MAX_BATCH:
                raise InvalidArgumentError(f"{name}: {len(getattr(req, name))} request ids; at most {MAX_BATCH}",
                                           field=name)  # fmt: skip
        held = [
            local_pb2.PublishLease(request_id=rid, expires_unix_ms=entry.expires_unix_ms)
            for rid in req.publishes
            if (entry := self.publisher.holding(rid)) is not None
        ]
        reg = self.registry.registration
        return local_pb2.StatusResponse(publishes=held, unsettled=self.puller.unsettled.still(req.unsettled),
            engine_id=self.settings.engine_id, instance_id=self.instance_id, role=self.settings.role,
            backend=self.dp.backend, registered=reg is not None, draining=self.draining,
            leases=len(self.publisher.publishes), transfers_in_flight=len(self.puller.pulls), peers=len(self.peers),
            peer_address=self.peer_address, registered_bytes=reg.nbytes if reg else 0,
            protocol_version=PROTOCOL_VERSION, groups=list(reg.groups) if reg else [],
        )  # fmt: skip

    async def stream_step(self, req: local_pb2.StreamStepRequest) -> local_pb2.StreamStepResponse:
        """StreamStep (layer-wise push): the requests this engine step computes."""
        self._require_role("prefill", "StreamStep")
        return self.streamer.step(req)

    async def layer_done(self, req: local_pb2.LayerDoneRequest) -> local_pb2.LayerDoneResponse:
        """LayerDone (layer-wise push): a layer of the step is computed; its WRITEs start now."""
        self._require_role("prefill", "LayerDone")
        return self.streamer.layer_done(req)

    async def agent_jobs(self, req: local_pb2.AgentJobsRequest) -> local_pb2.AgentJobsResponse:
        """AgentJobs: the next jobs of the worker's own data-plane agent (``--backend worker``)."""
        agent = self._worker_agent_dp("AgentJobs")
        reg = self.registry.require()
        if req.epoch and req.epoch != reg.epoch:
            raise FailedPreconditionError(
                f"epoch: the agent serves registration {req.epoch}, the sidecar holds {reg.epoch} (register again)",
                field="epoch", reason=Reason.NOT_REGISTERED,
            )  # fmt: skip
        wait = float(req.wait_seconds)
        if not 0 <= wait <= MAX_AGENT_WAIT_S:
            raise InvalidArgumentError(f"wait_seconds: {req.wait_seconds} is not in [0, {MAX_AGENT_WAIT_S:g}]",
                                       field="wait_seconds")  # fmt: skip
        return local_pb2.AgentJobsResponse(jobs=await agent.next_jobs(int(req.max_jobs), wait))

    async def agent_report(self, req: local_pb2.AgentReportRequest) -> local_pb2.AgentReportResponse:
        """AgentReport: outcomes of jobs the worker's agent ran."""
        self._worker_agent_dp("AgentReport").report(list(req.outcomes))
        return local_pb2.AgentReportResponse()

    def _worker_agent_dp(self, what: str) -> WorkerAgentTransport:
        if not isinstance(self.dp, WorkerAgentTransport):
            raise FailedPreconditionError(
                f"{what}: this sidecar's data plane ({self.dp.backend}) runs in the sidecar; only --backend worker "
                "hands jobs to the worker's agent",
                field="backend", reason=Reason.WRONG_BACKEND,
            )  # fmt: skip
        return self.dp

    async def watch(self, req: local_pb2.WatchCompletionsRequest) -> AsyncIterator[local_pb2.Completion]:
        """WatchCompletions."""
        async for ev in self.hub.watch(replay=bool(req.replay), after=int(req.after_sequence)):
            yield ev

    # ================================================================== peer API
    # ``creds`` says which engine ids the caller may act as (from its certificate; see peer_auth).
    async def peer_handshake(
        self, req: peer_pb2.HandshakeRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.HandshakeResponse:
        """Handshake: refuse impostors and incompatible readers (every difference listed)."""
        return self.publisher.readers.handshake(req, creds)

    async def peer_get_published(
        self, req: peer_pb2.GetPublishedRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.GetPublishedResponse:
        """GetPublished: a reader asks for a published request's blocks and regions."""
        return self.publisher.get_published(req, creds)

    async def peer_get_published_batch(
        self, req: peer_pb2.GetPublishedBatchRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.GetPublishedBatchResponse:
        """GetPublishedBatch: several lookups, each answered (or refused) on its own."""
        return self.publisher.get_published_batch(req, creds)

    async def peer_notify(
        self, req: peer_pb2.NotifyRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.NotifyResponse:
        """Notify: a reader is done; free the blocks once every expected reader is."""
        return self.publisher.notify(req, creds)

    async def peer_notify_batch(
        self, req: peer_pb2.NotifyBatchRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.NotifyBatchResponse:
        """NotifyBatch: several notices at once (a bad one, e.g. an unknown outcome, is dropped; the others count)."""
        return self.publisher.notify_batch(req, creds)

    async def peer_hold(self, req: peer_pb2.HoldRequest, creds: PeerCredentials = ANONYMOUS) -> peer_pb2.HoldResponse:
        """Hold: a reader still wants these requests; extend their leases."""
        return self.publisher.hold(req, creds)

    async def peer_offer(
        self, req: peer_pb2.OfferRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.OfferResponse:
        """Offer (push mode): a reader's blocks for a request, written once it is published here."""
        self._require_role("prefill", "Offer")
        self._refuse_if_draining("Offer")
        return self.pusher.offer(req, creds)

    async def peer_landed(
        self, req: peer_pb2.LandedRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.LandedResponse:
        """Landed (push mode): a writer's WRITEs into this rank ended."""
        return self.puller.landed(req, creds)

    async def peer_revoke(
        self, req: peer_pb2.RevokeRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.RevokeResponse:
        """Revoke (push mode): a reader takes its offer back; answered once nothing more can land."""
        return await self.pusher.revoke(req, creds)

    async def peer_abort(
        self, req: peer_pb2.PeerAbortRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.PeerAbortResponse:
        """Abort from a peer: drop our publish and/or cancel our pull of that request."""
        rid = check_id(req.request_id, "request_id")
        creds.check(req.engine_id, "engine_id")
        reader = self.publisher.knows(req.engine_id, req.instance_id)
        publishers = {
            s.address for s in self.peers.sessions()
            if s.identity.engine_id == req.engine_id and s.identity.instance_id == req.instance_id
        }  # fmt: skip
        if not reader and not publishers:
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}) has not handshaken with this sidecar; "
                f"abort of {rid!r} refused",
                field="engine_id", reason=Reason.NOT_HANDSHAKEN,
            )  # fmt: skip
        reason = f"aborted by peer {req.engine_id}" + (f": {req.reason}" if req.reason else "")
        # First the one step that may refuse (PERMISSION_DENIED when the publish is bound to another
        # reader), and it refuses before it changes anything: a refused Abort cancels no pull, drops no hold.
        found = self.publisher.peer_abort(req, reason) if reader else False
        if publishers:
            # A publisher the request is expected from dropped it: its grants no longer hold, and a pull
            # to come must ask it (and fail). Any other caller's abort leaves the holds alone.
            self.holds.drop_publishers(rid, publishers)
        found = self.puller.peer_abort(rid, publishers, reason) or found
        return peer_pb2.PeerAbortResponse(found=found)

    # ================================================================== worker liveness
    def lease_closed(self, handle: str) -> None:
        """A descriptor-socket connection closed; when it was the worker's, the worker is gone."""
        reg = self.registry.registration
        if reg is not None and handle in reg.leases:
            asyncio.get_running_loop().create_task(self.worker_gone(reg.epoch))

    async def worker_gone(self, epoch: int) -> None:
        """The worker that registered ``epoch`` exited: nothing it registered may be read or written again.

        Its publishes are aborted (readers get ABORTED: the blocks no longer exist), the offers of
        requests it never published fail, its pulls are cancelled (publishers are told to drop
        theirs), its memory is deregistered and unmapped, and
        the sidecar reports NOT_SERVING until a worker registers again, which it may at once.
        """
        reg = self.registry.registration
        if reg is None or reg.epoch != epoch:
            return  # already replaced by a new registration
        why = f"worker {reg.worker_id or '(unnamed)'} (tp rank {reg.rank.tp_rank}) exited"
        log.warning("worker gone; dropping its registration", extra={"epoch": epoch, "worker": reg.worker_id,
                    "leases": len(self.publisher.publishes), "pulls": len(self.puller.pulls)})  # fmt: skip
        self._on_serving(False)
        self.holds.clear()
        self.puller.prepared.clear()
        for rid in list(self.publisher.publishes):
            self.publisher.abort(rid, why)
        # A cancelled READ returns once fenced (up to the fence budget): the memory goes only after.
        await self.puller.cancel_all(why, wait=2.0 + self.settings.fence_budget_seconds)
        await self.pusher.worker_gone(why)
        if self.registry.registration is reg:
            self.registry.drop()
            self.topologies.clear()

    # ================================================================== drain / shutdown
    async def drain(self, budget: float | None = None) -> local_pb2.DrainResponse:
        """Refuse new work, let in-flight pulls and published leases finish, then release the rest.

        ``budget`` (seconds; None: --drain-seconds) is checked before anything changes: a bad one
        (negative, NaN, infinite, above --drain-seconds) is INVALID_ARGUMENT and drains nothing.
        """
        if budget is not None:
            check_drain_timeout(budget, self.settings.drain_seconds)
        if self._drained is None:
            self.draining = True  # from this call on, not from the task's first step
            self._on_serving(False)
            # The drain runs as a task of its own: a caller that stops waiting (its deadline passed,
            # it went away) must not leave the sidecar half drained, refusing work but never done.
            self._drained = asyncio.ensure_future(self._drain(budget))
        return await asyncio.shield(self._drained)

    async def _drain(self, budget: float | None) -> local_pb2.DrainResponse:
        budget = self.settings.drain_seconds if budget is None else budget
        pulls, publishes = self.puller.pulls, self.publisher.publishes
        log.info("draining", extra={"budget_seconds": budget, "pulls": len(pulls), "leases": len(publishes)})
        deadline = time.monotonic() + budget
        start_pulls = len(pulls)
        while (pulls or publishes) and time.monotonic() < deadline:  # noqa: ASYNC110 - two dicts to watch
            await asyncio.sleep(min(0.02, max(deadline - time.monotonic(), 0)))
        abandoned = await self.puller.cancel_all("the sidecar's drain budget ran out", wait=2.0)
        released = self.publisher.release_all("sidecar drained before the decode side confirmed; blocks released")
        resp = local_pb2.DrainResponse(
            completed=max(start_pulls - abandoned, 0), abandoned=abandoned, released_leases=released
        )
        log.info("drained", extra={"abandoned": abandoned, "released_leases": released})
        self.drain_done.set()
        return resp

    async def close(self) -> None:
        """Cancel everything and release memory (after the servers stopped)."""
        tasks: list[asyncio.Task[None]] = [p.task for p in self.puller.pulls.values() if p.task is not None]
        tasks += self.pusher.cancel_all()
        for p in self.puller.pulls.values():
            if p.task is not None:
                p.abort_reason = "the sidecar is stopping"
                p.task.cancel()
        if tasks:  # their transfers return once fenced (up to the fence budget), before the memory goes
            await asyncio.wait(tasks, timeout=5.0 + self.settings.fence_budget_seconds)
        self.puller.unsettled.close()
        await self.holds.close()
        await self.outbox.close()
        for rid in list(self.publisher.publishes):
            self.publisher.drop(rid)
        self.hub.close()
        await self.peers.close()
        self.registry.close()
        self.dp.close()
