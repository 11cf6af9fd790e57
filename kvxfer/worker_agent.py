"""A data-plane agent in the worker's own process, driven by its sidecar (``kvxfer serve --backend worker``).

CUDA does not let a process export again GPU memory it opened by IPC, so a sidecar cannot register
a worker's KV tensors with an RDMA NIC. The route that surely works is the one vLLM's NixlConnector
takes: the worker's process registers its own memory with its own agent. :class:`WorkerAgent` is
that agent (any kvxfer backend: NIXL by default) and does nothing on its own: the sidecar keeps
authentication, publishes, leases, topology and descriptors, and hands it jobs (load a peer's
agent, forget one, READ these descriptors from that peer) which it takes with ``AgentJobs`` and
answers with ``AgentReport``, both on the sidecar's fast socket.

Use::

    agent = WorkerAgent()                            # a NIXL agent in this process
    ref = agent.register(layout, tensors)            # one per cache group: the worker's own addresses
    resp = await client.register_caches({"attn": (layout, ref)}, worker_agent=agent.info())
    task = asyncio.ensure_future(agent.serve(client))  # until await agent.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc

from kvxfer.client import AsyncClient, KvxferRpcError
from kvxfer.errors import InvalidArgumentError, KvxferError, Reason
from kvxfer.layout import KVCacheLayout
from kvxfer.logs import get_logger
from kvxfer.memory import LibraryRef
from kvxfer.topology import RegionTable
from kvxfer.transport import (
    Registration,
    Transport,
    TransportConfig,
    UnfencedOp,
    WorkerAgentInfo,
    create_transport,
    unfenced_op,
)
from kvxfer.transport.worker_agent import descriptors_from_bytes
from kvxfer.wire import local_pb2

__all__ = ["WorkerAgent"]

log = get_logger("kvxfer.worker_agent")

#: One AgentJobs long poll (the sidecar answers at once when jobs wait).
POLL_WAIT_S = 5.0
#: Longest pause between attempts while the sidecar cannot be reached or has no registration.
RETRY_MAX_S = 2.0
#: How often an operation reported unfenced is looked at again (the long poll is this short meanwhile).
WATCH_S = 0.1


class WorkerAgent:
    """A data-plane agent in this process that the sidecar drives (see the module docs)."""

    def __init__(self, backend: str = "nixl", *, name: str = "", config: TransportConfig | None = None) -> None:
        # The worker owns its memory: no same-host shortcut through another process's mapping.
        config = (config or TransportConfig()).replace(cuda_ipc_direct=False)
        self.name = name or f"kvxfer-worker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.transport: Transport = create_transport(backend, self.name, config)
        self._registrations: list[Registration] = []
        self._transfers: dict[int, asyncio.Task[None]] = {}
        self._started: dict[int, float] = {}  # transfer job id -> time.monotonic() it started
        self._outcomes: list[local_pb2.AgentOutcome] = []
        #: Transfer jobs reported unfenced, by id: the sidecar hears when each operation ended.
        self._watching: dict[int, UnfencedOp] = {}
        self._reporting: asyncio.Task[None] | None = None
        self._client: AsyncClient | None = None  # what serve() polls; outcomes go back on it
        self._closed = False
        self.jobs_run = 0  # transfers this agent moved (tests and benches read it)

    # ------------------------------------------------------------------ registration
    def register(self, layout: KVCacheLayout, regions: Sequence[Any]) -> LibraryRef:
        """Register one cache group's regions (tensors or arrays, one per region, in region order).

        Returns what the group's ``RegisterCaches`` entry carries: this process's own addresses.
        """
        ref = LibraryRef.from_arrays(regions)
        return self.register_addresses(layout, ref)

    def register_addresses(self, layout: KVCacheLayout, ref: LibraryRef) -> LibraryRef:
        """Register regions given by address (they must stay allocated while registered)."""
        if ref.pid != os.getpid():
            raise InvalidArgumentError(f"memory.library.pid: {ref.pid} is not this process ({os.getpid()})",
                                       field="memory.library.pid")  # fmt: skip
        table = RegionTable.for_layout(layout, list(ref.addresses), device=ref.device)
        self._registrations.append(self.transport.register(table, "VRAM" if ref.memory_type == "VRAM" else "DRAM"))
        return ref

    def info(self) -> WorkerAgentInfo:
        """What ``RegisterCaches.worker_agent`` carries (call after registering the memory)."""
        return WorkerAgentInfo(self.transport.backend, self.transport.agent_name, self.transport.metadata(),
                               os.getpid())  # fmt: skip

    # ------------------------------------------------------------------ serving the sidecar
    async def serve(self, client: AsyncClient) -> None:
        """Take and run the sidecar's jobs until :meth:`close` (survives sidecar restarts)."""
        self._client = client
        pause = 0.05
        while not self._closed:
            self._report_ended()
            try:
                jobs = await client.agent_jobs(wait_seconds=WATCH_S if self._watching else POLL_WAIT_S)
            except KvxferRpcError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                # No registration yet, or the sidecar is restarting: the worker registers again.
                log.debug("no jobs from the sidecar", extra={"error": exc.details})
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            pause = 0.05
            for job in jobs:
                self._run(job)

    def _run(self, job: local_pb2.AgentJob) -> None:
        kind = job.WhichOneof("kind")
        if kind == "transfer":
            self._started[job.id] = time.monotonic()
            self._transfers[job.id] = asyncio.ensure_future(self._transfer(job.id, job.transfer))
        elif kind == "cancel":
            task = self._transfers.get(job.cancel)
            if task is not None:
                task.cancel()  # its outcome still goes back, once the transport's fence is over
        elif kind == "load_peer":
            try:
                name = self.transport.add_peer(job.load_peer)
            except KvxferError as exc:
                self._report(_failed(job.id, exc))
            else:
                log.debug("peer agent loaded", extra={"peer": name})
                self._report(local_pb2.AgentOutcome(id=job.id, peer=name))  # the sidecar stops tracking the load
        elif kind == "forget_peer":
            self.transport.remove_peer(job.forget_peer)

    async def _transfer(self, job_id: int, t: local_pb2.AgentTransfer) -> None:
        try:
            local = descriptors_from_bytes(t.local, "transfer.local")
            remote = descriptors_from_bytes(t.remote, "transfer.remote")
            res = await self.transport.transfer(
                "READ" if t.op == "READ" else "WRITE", local, remote, t.peer, timeout=t.timeout_seconds,
                notify=t.notify or None, mem_type="VRAM" if t.memory_type == "VRAM" else "DRAM",
                remote_mem_type="VRAM" if t.remote_memory_type == "VRAM" else "DRAM",
            )  # fmt: skip
        except asyncio.CancelledError as exc:
            # The sidecar gave up on it and waits to hear whether the operation ended.
            unfenced = unfenced_op(exc)
            self._report(local_pb2.AgentOutcome(
                id=job_id, code=grpc.StatusCode.CANCELLED.value[0], message="cancelled",
                reason=Reason.DATA_PLANE_UNFENCED.value if unfenced is not None else "",
            ))  # fmt: skip
            self._watch(job_id, unfenced)
        except KvxferError as exc:
            self._report(_failed(job_id, exc))
            self._watch(job_id, unfenced_op(exc))
        except Exception as exc:  # a library's own exception: still an outcome, never a silent hang
            self._report(_failed(job_id, KvxferError(f"{type(exc).__name__}: {exc}")))
        else:
            self.jobs_run += 1
            self._report(local_pb2.AgentOutcome(id=job_id, bytes=res.bytes, descriptors=res.descriptors,
                                                seconds=res.seconds))  # fmt: skip
        finally:
            self._transfers.pop(job_id, None)
            self._started.pop(job_id, None)

    def quiet_since(self, since: float) -> bool:
        """Whether no transfer this agent started before ``since`` (time.monotonic()) can still land: none
        of them still runs, and none reported unfenced is still unseen to end. Only reads: the vLLM
        connector asks from its own thread (the ``ended`` flags are looked at again every ``WATCH_S``)."""
        if any(at < since for at in list(self._started.values())):
            return False
        return all(op.ended for op in list(self._watching.values()))

    def _watch(self, job_id: int, unfenced: UnfencedOp | None) -> None:
        if unfenced is not None and unfenced.watched:
            self._watching[job_id] = unfenced

    def _report_ended(self) -> None:
        """Tell the sidecar about each operation reported unfenced that has ended since."""
        if not self._watching:
            return
        self.transport.unfenced_live()  # looks again
        for job_id, unfenced in list(self._watching.items()):
            if unfenced.ended:
                self._report(local_pb2.AgentOutcome(id=job_id, ended=True))
            if unfenced.ended or not unfenced.watched:
                del self._watching[job_id]

    def _report(self, outcome: local_pb2.AgentOutcome) -> None:
        self._outcomes.append(outcome)
        if self._reporting is None or self._reporting.done():
            self._reporting = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        # Outcomes that arrive while a report is on its way go together in the next one.
        while self._outcomes and self._client is not None:
            batch, self._outcomes = self._outcomes, []
            try:
                await self._client.agent_report(batch)
            except KvxferRpcError as exc:
                # The sidecar restarted or dropped the registration: its waiters are gone with it.
                log.warning("could not report to the sidecar", extra={"error": exc.details, "outcomes": len(batch)})
            except Exception as exc:  # the client closed under a report (the worker is closing)
                log.debug("report not sent", extra={"error": repr(exc), "outcomes": len(batch)})

    # ------------------------------------------------------------------ teardown
    async def aclose(self) -> None:
        """Stop serving, cancel the transfers and wait until each ended (its transport's fence: at most
        the fence budget and a second), then :meth:`close`. Call it on the loop that serves the sidecar."""
        self._closed = True
        running = [t for t in self._transfers.values() if not t.done()]
        for task in running:
            task.cancel()
        if running:
            # Deregistering under a READ still in flight would let it land in memory the worker frees next.
            await asyncio.wait(running, timeout=self.transport.config.fence_budget_s + 1.0)
        self.close()

    def close(self) -> None:
        """Stop serving, cancel transfers, deregister and release the agent, without waiting for the
        cancelled transfers to end (:meth:`aclose` waits)."""
        self._closed = True
        for task in self._transfers.values():
            task.cancel()
        self._transfers.clear()
        for reg in self._registrations:
            with contextlib.suppress(Exception):
                self.transport.deregister(reg)
        self._registrations.clear()
        self.transport.close()


def _failed(job_id: int, exc: KvxferError) -> local_pb2.AgentOutcome:
    """The outcome of a failed job: the error's status code and machine-readable reason."""
    code = grpc.StatusCode[exc.status].value[0] if exc.status in grpc.StatusCode.__members__ else 2
    reason = exc.reason.value if isinstance(exc.reason, Reason) else str(exc.reason)
    return local_pb2.AgentOutcome(id=job_id, code=code, reason=reason, message=exc.message)
