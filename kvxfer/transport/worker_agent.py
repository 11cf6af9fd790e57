"""``--backend worker``: the data plane runs in the worker's process, driven by the sidecar.

CUDA will not export again memory a process opened by IPC, so a sidecar cannot register a GPU
worker's KV memory with an RDMA NIC itself. Here the worker's process owns the agent (a NIXL agent
that registered the worker's own tensors, as vLLM's NixlConnector does: :mod:`kvxfer.worker_agent`)
and the sidecar keeps everything else: authentication, publishes and leases, topology,
descriptors, retries. The sidecar's side is this :class:`WorkerAgentTransport`; every operation of
the :class:`~kvxfer.transport.base.Transport` interface becomes a job that the worker's agent takes
with ``AgentJobs`` (a long poll on the fast socket) and answers with ``AgentReport``.

The agent's metadata reaches peers only in the authenticated handshake, as any backend's does. A
peer's :meth:`metadata` is a serialized ``WorkerAgent`` message: its name travels with it, so
:meth:`add_peer` answers at once and the load runs as the worker's next job (jobs run in order).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvxfer.errors import FailedPreconditionError, InvalidArgumentError, Reason
from kvxfer.logs import get_logger
from kvxfer.topology import RegionTable
from kvxfer.transport.base import (
    U64,
    UNFENCED_CANCEL,
    MemType,
    Notification,
    Op,
    Registration,
    TransferResult,
    Transport,
    TransportConfig,
    WorkerAgentInfo,
    check_descriptors,
)
from kvxfer.transport.errors import (
    PeerUnknownError,
    RegistrationError,
    TransferFailedError,
    TransferTimeoutError,
    TransferUnfencedError,
    TransportError,
    UnfencedOp,
)
from kvxfer.transport.registry import register_transport
from kvxfer.wire import local_pb2
from kvxfer.wire.convert import worker_agent_from_proto, worker_agent_to_proto

__all__ = ["WorkerAgentTransport", "descriptors_from_bytes", "descriptors_to_bytes"]

log = get_logger("kvxfer.transport.worker_agent")

#: How much longer than a transfer's own timeout the sidecar waits for the worker's outcome (the
#: worker enforces the timeout; this covers the report's way back).
REPORT_GRACE_S = 1.0
#: A job given up on whose outcome has not come this long after is forgotten (the agent lost it).
FORGET_GIVEN_UP_S = 600.0
#: Most unfenced jobs watched at once; past it the oldest is let go (``watched`` false: its pull's hold
#: at the sidecar, ``--unfenced-hold-seconds``, decides when its blocks go back).
MAX_WATCHED = 4096


def descriptors_to_bytes(desc: U64) -> bytes:
    """(N, 3) uint64 descriptors as little-endian bytes."""
    return np.ascontiguousarray(desc, dtype="<u8").tobytes()


def descriptors_from_bytes(raw: bytes, field: str) -> U64:
    """The inverse of :func:`descriptors_to_bytes`; raises naming ``field`` on a bad length."""
    if len(raw) % 24:
        raise InvalidArgumentError(f"{field}: {len(raw)} bytes is not a whole number of 24-byte descriptors",
                                   field=field)  # fmt: skip
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 3).astype(np.uint64)


class _Pending:
    """A transfer handed to the worker, waiting for its outcome."""

    def __init__(self, job: local_pb2.AgentJob, future: asyncio.Future[local_pb2.AgentOutcome]) -> None:
        self.job = job
        self.future = future
        #: Set once the transfer is known unfenced (an outcome said so, or none came): what its error carries.
        self.unfenced: UnfencedOp | None = None


@register_transport("worker")
class WorkerAgentTransport(Transport):
    """The sidecar's side of a data plane that runs in the worker's process (module docs)."""

    #: The worker's memory is mapped nowhere but in the worker: no same-host device-copy shortcut.
    same_host_shortcut = False
    in_worker = True

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        self.worker: WorkerAgentInfo | None = None
        # Unique across sidecar processes: the worker's agent outlives a sidecar restart, and what it reports
        # late (outcomes, ``ended`` notices) of the old sidecar's jobs reaches the new one, which must not
        # take them for its own jobs.
        self._ids = itertools.count((secrets.randbits(31) << 32) + 1)
        self._queue: list[local_pb2.AgentJob] = []
        self._wakeup: asyncio.Event | None = None
        self._pending: dict[int, _Pending] = {}
        self._peer_loads: dict[int, str] = {}  # job id -> peer name, for messages
        #: Transfer jobs reported unfenced, by id: each ends with the agent's outcome or late notice.
        self._watched: dict[int, UnfencedOp] = {}
        #: Jobs given up on whose outcome is still due, by id: when (time.monotonic()).
        self._given_up: dict[int, float] = {}

    # ------------------------------------------------------------------ the worker's side
    def bind_worker(self, info: WorkerAgentInfo | None) -> None:
        """The worker registered (``info``: its agent) or went away (None).

        A new agent (a restarted worker) starts from nothing: jobs meant for the old one are dropped
        and its transfers fail.
        """
        if info is not None and self.worker is not None and info == self.worker:
            return
        if self.worker is not None:
            change = "went away" if info is None else f"was replaced by {info.agent_name!r}"
            self._fail_all(f"the worker's agent {self.worker.agent_name!r} {change}")
        self._queue.clear()
        self.worker = info

    async def next_jobs(self, max_jobs: int, wait_s: float) -> list[local_pb2.AgentJob]:
        """Jobs for the worker's agent, waiting up to ``wait_s`` for a first one (``AgentJobs``)."""
        if self.worker is None:
            raise FailedPreconditionError(
                "AgentJobs: no worker agent is registered (RegisterCaches with worker_agent first)",
                field="worker_agent", reason=Reason.NOT_REGISTERED,
            )  # fmt: skip
        if not self._queue and wait_s > 0:
            wakeup = self._event()
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), wait_s)
            except TimeoutError:
                return []
        n = len(self._queue) if max_jobs <= 0 else min(max_jobs, len(self._queue))
        jobs, self._queue = self._queue[:n], self._queue[n:]
        return jobs

    def report(self, outcomes: list[local_pb2.AgentOutcome]) -> None:
        """Outcomes of jobs the worker ran (``AgentReport``); unknown ids (given up on) are ignored."""
        for o in outcomes:
            if not o.ended:
                pending = self._pending.pop(o.id, None)
                self._given_up.pop(o.id, None)
                if pending is not None and o.reason == Reason.DATA_PLANE_UNFENCED.value:
                    # Watched from now on: the agent's late notice may come in this same report, before
                    # the waiting transfer runs again.
                    self._watch(pending)
                if pending is not None and not pending.future.done():
                    pending.future.set_result(o)
            watched = self._watched.get(o.id)
            if watched is not None and (o.ended or o.reason != Reason.DATA_PLANE_UNFENCED.value):
                watched.ended = True  # the agent saw its operation end: no byte of it lands any more
                del self._watched[o.id]
            name = self._peer_loads.pop(o.id, None)
            if name is not None and o.code:
                # Transfers to this peer will fail with the library's words; say why here too.
                self._log_load_failure(name, o)

    # ------------------------------------------------------------------ Transport
    def register(self, table: RegionTable, mem_type: MemType = "DRAM") -> Registration:
        """Nothing to register here: the worker's agent registered its own memory."""
        if self.worker is None:
            raise FailedPreconditionError(
                "worker_agent: the worker registered no agent of its own; with --backend worker the worker runs the "
                "data plane (vLLM connector: data_plane 'worker'; kvxfer.worker_agent.WorkerAgent)",
                field="worker_agent", reason=Reason.WRONG_BACKEND,
            )  # fmt: skip
        self._track(table)
        return Registration(table, mem_type, None)

    def deregister(self, registration: Registration) -> None:
        """Forget ``registration``; once nothing is registered the worker is gone for this sidecar."""
        self._untrack(registration.table)
        if not self._registered:
            self.bind_worker(None)

    def metadata(self) -> bytes:
        """The worker's agent as a serialized ``WorkerAgent`` (what a peer's :meth:`add_peer` reads)."""
        if self.worker is None:
            raise RegistrationError("no worker agent registered yet", backend=self.name)
        return worker_agent_to_proto(self.worker).SerializeToString()

    def add_peer(self, metadata: bytes) -> str:
        """Queue the load of a peer's agent; returns its name at once (jobs run in order)."""
        try:
            msg = local_pb2.WorkerAgent.FromString(metadata)
            peer = worker_agent_from_proto(msg, "handshake.data_plane.metadata")
        except (DecodeError, InvalidArgumentError) as exc:
            raise PeerUnknownError("unreadable peer metadata (is the peer a --backend worker sidecar?)",
                                   backend=self.name, detail=str(exc)) from None  # fmt: skip
        mine = self.worker.backend if self.worker is not None else None
        if mine is not None and peer.backend != mine:
            raise PeerUnknownError(
                f"the peer's worker runs {peer.backend!r}, this one {mine!r}; both ends need one library",
                backend=self.name, peer=peer.agent_name,
            )  # fmt: skip
        job_id = self._enqueue(local_pb2.AgentJob(load_peer=peer.metadata))
        self._peer_loads[job_id] = peer.agent_name
        return peer.agent_name

    def remove_peer(self, peer: str) -> None:
        """Queue forgetting ``peer`` in the worker's agent."""
        if self.worker is not None:
            self._enqueue(local_pb2.AgentJob(forget_peer=peer))

    async def transfer(
        self,
        op: Op,
        local: U64,
        remote: U64,
        peer: str,
        *,
        timeout: float,
        notify: bytes | None = None,
        mem_type: MemType = "DRAM",
        remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:
        """Hand the transfer to the worker's agent and wait for its outcome."""
        local, remote = check_descriptors(local, remote)
        if self.worker is None:
            raise TransferFailedError("no worker agent registered", backend=self.name, peer=peer)
        job = local_pb2.AgentJob(
            transfer=local_pb2.AgentTransfer(
                op=op, local=descriptors_to_bytes(local), remote=descriptors_to_bytes(remote), peer=peer,
                timeout_seconds=timeout, notify=notify or b"", memory_type=mem_type,
                remote_memory_type=remote_mem_type,
            )
        )  # fmt: skip
        future: asyncio.Future[local_pb2.AgentOutcome] = asyncio.get_running_loop().create_future()
        self._forget_lost()
        job_id = self._enqueue(job)
        pending = self._pending[job_id] = _Pending(job, future)
        try:
            # The worker's agent reports a failure once its fence allows (its own fence budget, which
            # is taken to be this one's): wait for that too.
            wait = timeout + REPORT_GRACE_S + self.config.fence_budget_s
            outcome = await asyncio.wait_for(asyncio.shield(future), wait)
        except TimeoutError:
            if not self._give_up(job_id):
                raise TransferTimeoutError(f"{op} of {len(local)} descriptors: the worker's agent did not take it "
                                           f"within {wait:g} s", backend=self.name, peer=peer) from None  # fmt: skip
            # Whether the worker's agent still has the operation in flight is unknown: not fenced.
            self._count_unfenced(op, peer)
            raise TransferUnfencedError(
                f"{op} of {len(local)} descriptors: no outcome from the worker's agent within {timeout:g} s (+"
                f"{REPORT_GRACE_S:g} s, + the fence budget {self.config.fence_budget_s:g} s), so its bytes may "
                f"still land; {self._describe(op, local, remote)}",
                backend=self.name, peer=peer, timed_out=True, unfenced=self._watch(pending),
            ) from None  # fmt: skip
        except asyncio.CancelledError:
            if not self._give_up(job_id):
                raise  # never handed out: nothing ran
            # The agent answers a cancel once its own fence is over: until then the bytes may land.
            if await self._cancel_fenced(future):
                raise
            self._count_unfenced(op, peer)
            raise asyncio.CancelledError(UNFENCED_CANCEL, self._watch(pending)) from None
        if outcome.code:
            err = _outcome_error(outcome, self.name, peer, self._describe(op, local, remote))
            if isinstance(err, TransferUnfencedError):
                err.unfenced = self._watch(pending)
            raise err
        return TransferResult(int(outcome.bytes), int(outcome.descriptors), float(outcome.seconds))

    async def _cancel_fenced(self, future: asyncio.Future[local_pb2.AgentOutcome]) -> bool:
        """After a cancel: whether the agent said, within the fence budget, that the operation ended."""
        deadline = asyncio.get_running_loop().time() + self.config.fence_budget_s + REPORT_GRACE_S
        while not future.done():
            try:
                await asyncio.wait_for(asyncio.shield(future), max(deadline - asyncio.get_running_loop().time(), 0))
            except TimeoutError:
                return False
            except asyncio.CancelledError:
                continue  # cancelled again: the answer still decides what the cancel says
        return future.result().reason != Reason.DATA_PLANE_UNFENCED.value

    def _watch(self, pending: _Pending) -> UnfencedOp:
        """What an unfenced job's error carries: it ends with the agent's outcome or its late notice
        (watched once, from the first of: the unfenced outcome, the sidecar giving up on it)."""
        if pending.unfenced is None:
            t = pending.job.transfer
            pending.unfenced = self._watched[pending.job.id] = UnfencedOp(t.op, t.peer)
            while len(self._watched) > MAX_WATCHED:
                self._watched.pop(next(iter(self._watched))).watched = False
        return pending.unfenced

    def _forget_lost(self) -> None:
        """Forget the jobs given up on long ago whose outcome never came (the agent lost them)."""
        if not self._given_up:
            return
        too_old = time.monotonic() - FORGET_GIVEN_UP_S
        for job_id in [j for j, at in self._given_up.items() if at < too_old]:
            del self._given_up[job_id]
            self._pending.pop(job_id, None)

    def unfenced_live(self) -> int:
        return len(self._watched)

    def poll_notifications(self) -> list[Notification]:
        """The sidecar attaches no notifications to this backend's transfers."""
        return []

    def close(self) -> None:
        """Fail whatever waits; the worker's agent is the worker's to close."""
        self._fail_all("the sidecar is closing")
        self._queue.clear()
        self.worker = None

    # ------------------------------------------------------------------ helpers
    def _event(self) -> asyncio.Event:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        return self._wakeup

    def _enqueue(self, job: local_pb2.AgentJob) -> int:
        job.id = next(self._ids)
        self._queue.append(job)
        if self._wakeup is not None:
            self._wakeup.set()
        return job.id

    def _give_up(self, job_id: int) -> bool:
        """Stop waiting for a transfer job. Returns whether the agent had taken it (it is told to cancel
        it, and its outcome still comes: :meth:`report`)."""
        pending = self._pending.get(job_id)
        if pending is None:
            return False
        if pending.job in self._queue:
            del self._pending[job_id]
            self._queue.remove(pending.job)  # never handed out: nothing to cancel
            return False
        self._enqueue(local_pb2.AgentJob(cancel=job_id))
        self._given_up[job_id] = time.monotonic()
        return True

    def _fail_all(self, why: str) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_result(
                    local_pb2.AgentOutcome(
                        id=pending.job.id, code=grpc.StatusCode.UNAVAILABLE.value[0], reason=Reason.WORKER_GONE.value,
                        message=why or "the worker's agent went away",
                    )
                )  # fmt: skip
        self._pending.clear()
        self._given_up.clear()
        self._peer_loads.clear()
        for watched in self._watched.values():
            watched.ended = True  # the agent went away, and the worker's memory with it
        self._watched.clear()

    def _log_load_failure(self, name: str, outcome: local_pb2.AgentOutcome) -> None:
        log.warning("the worker's agent could not load a peer", extra={"peer": name, "error": outcome.message})


def _outcome_error(outcome: local_pb2.AgentOutcome, backend: str, peer: str, what: str) -> TransportError:
    """The transport error a failed outcome stands for (by its code, never its text)."""
    detail = f"{outcome.message}; {what}"
    if outcome.reason == Reason.DATA_PLANE_UNFENCED.value:
        return TransferUnfencedError("the worker's agent failed the transfer while it was still in flight after its "
                                     "fence budget, so its bytes may still land", backend=backend, peer=peer,
                                     detail=detail)  # fmt: skip
    if outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]:
        return TransferTimeoutError("the worker's agent timed out", backend=backend, peer=peer, detail=detail)
    if outcome.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
        return PeerUnknownError("the worker's agent does not know the peer", backend=backend, peer=peer,
                                detail=detail)  # fmt: skip
    return TransferFailedError("the worker's agent failed the transfer", backend=backend, peer=peer, detail=detail)
