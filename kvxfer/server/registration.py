"""The worker's registration: its cache groups, their memory, and who this sidecar is to peers.

One sidecar serves one worker rank (``RegisterCaches``): the memory it described is attached
(shared memory, descriptors, CUDA IPC, or this process's own) and registered with the data plane.
The same rank may register again (a restarted worker) while nothing is published or pulled; every
registration gets a new epoch, which peers see in the handshake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from kvxfer import PROTOCOL_VERSION
from kvxfer.config import Settings
from kvxfer.errors import FailedPreconditionError, InvalidArgumentError, Reason
from kvxfer.layout import KVCacheLayout
from kvxfer.logs import get_logger
from kvxfer.memory import AttachedMemory, FdLookup, attach
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.identity import Identity, check_group_count
from kvxfer.server.state import Group, Registration
from kvxfer.server.validation import check_rank_heads
from kvxfer.transport import Transport, WorkerAgentInfo
from kvxfer.wire import common_pb2, local_pb2
from kvxfer.wire.convert import (
    check_id,
    layout_from_proto,
    memory_from_proto,
    rank_from_proto,
    regions_to_proto,
    worker_agent_from_proto,
)

__all__ = ["Registry"]

log = get_logger("kvxfer.server")


class Registry:
    """Owns the registration, its epoch and this sidecar's identity (see the module docs)."""

    def __init__(
        self, settings: Settings, data_plane: Transport, metrics: SidecarMetrics, *, instance_id: str,
        peer_address: str, fd_lookup: FdLookup | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.dp = data_plane
        self.metrics = metrics
        self.instance_id = instance_id
        self.peer_address = peer_address
        #: Set by the sidecar once its peer frames listener is bound ("": none).
        self.frames_address = ""
        self.registration: Registration | None = None
        self._fd_lookup = fd_lookup
        self._epoch = 0
        self._identity: Identity | None = None
        self._regions_msg: dict[tuple[str, int], list[common_pb2.Region]] = {}

    # ------------------------------------------------------------------ queries
    def require(self) -> Registration:
        """The registration, or FAILED_PRECONDITION when the worker has not registered yet."""
        if self.registration is None:
            raise FailedPreconditionError(
                "no KV caches registered with this sidecar yet (call RegisterCaches first)", field="groups",
                reason=Reason.NOT_REGISTERED,
            )  # fmt: skip
        return self.registration

    def identity(self) -> Identity:
        """This sidecar as its handshake describes it (needs a registration)."""
        reg = self.require()
        if self._identity is None or self._identity.epoch != reg.epoch:
            self._identity = Identity(
                PROTOCOL_VERSION, self.settings.engine_id, self.instance_id, reg.epoch, reg.rank, reg.layouts,
                self.dp.backend, self.dp.agent_name, self.dp.metadata(), self.peer_address, self.settings.role,
                {n: (g.memory.table, g.memory.mem_type) for n, g in reg.groups.items()}, self.frames_address,
            )  # fmt: skip
        return self._identity

    def regions_of(self, name: str, reg: Registration) -> list[common_pb2.Region]:
        """The region messages of group ``name`` (fixed per epoch, built once)."""
        key = (name, reg.epoch)
        msgs = self._regions_msg.get(key)
        if msgs is None:
            msgs = self._regions_msg[key] = regions_to_proto(reg.groups[name].memory.table)
        return msgs

    # ------------------------------------------------------------------ RegisterCaches
    def register(self, req: local_pb2.RegisterCachesRequest, *, busy: str = "") -> local_pb2.RegisterCachesResponse:
        """Attach and register the worker's memory; ``busy`` says why a registration cannot be replaced now."""
        if self.registration is not None and busy:
            raise FailedPreconditionError(f"groups: cannot replace the registration while {busy}", field="groups",
                                          reason=Reason.REGISTRATION_BUSY)  # fmt: skip
        if req.worker_id:  # optional; it goes into logs and messages, so checked as every id is
            check_id(req.worker_id, "worker_id")
        rank = rank_from_proto(req.rank, "rank")
        self._refuse_other_rank(req.worker_id, rank.tp_rank, rank.pp_rank, rank.tp_size, rank.pp_size)
        if not req.groups:
            raise InvalidArgumentError("groups: at least one cache group is needed", field="groups")
        check_group_count(len(req.groups), "groups")  # what a handshake carries: peers refuse more
        leases = self._worker_leases(req)
        agent = self._worker_agent(req)
        # Every group is checked and mapped before the data plane takes the agent: binding it ends the
        # registered agent's work, so a refused registration must not get that far.
        attached = self._attach_groups(req, rank, agent.pid if agent is not None else None)
        try:
            self.dp.bind_worker(agent)
        except BaseException:
            for _, memory in attached.values():
                memory.close()
            raise
        groups = self._register_groups(attached)
        old = self.registration
        self._epoch += 1
        self.registration = Registration(req.worker_id, rank, groups, self._epoch, leases)
        self._identity = None
        self._regions_msg.clear()
        if old is not None:
            self.release(old.groups.values())
        self.metrics.registered_bytes.set(self.registration.nbytes)
        log.info(
            "caches registered",
            extra={"groups": ",".join(groups), "bytes": self.registration.nbytes, "epoch": self._epoch,
                   "tp_rank": rank.tp_rank, "tp_size": rank.tp_size},
        )  # fmt: skip
        return local_pb2.RegisterCachesResponse(
            engine_id=self.settings.engine_id, instance_id=self.instance_id, epoch=self._epoch,
            registered_bytes=self.registration.nbytes, backend=self.dp.backend, peer_address=self.peer_address,
            fence_budget_seconds=self.settings.fence_budget_seconds,
        )  # fmt: skip

    def _worker_agent(self, req: local_pb2.RegisterCachesRequest) -> WorkerAgentInfo | None:
        """The worker's own data-plane agent, which ``--backend worker`` needs and other backends refuse."""
        agent = worker_agent_from_proto(req.worker_agent) if req.HasField("worker_agent") else None
        if agent is None and self.dp.in_worker:
            raise FailedPreconditionError(
                "worker_agent: this sidecar runs --backend worker, so the worker runs the data plane and must register "
                "its agent (vLLM connector: data_plane 'worker'; kvxfer.worker_agent.WorkerAgent)",
                field="worker_agent", reason=Reason.WRONG_BACKEND,
            )  # fmt: skip
        return agent

    def _worker_leases(self, req: local_pb2.RegisterCachesRequest) -> frozenset[str]:
        """Handles whose connection is the worker's life: its ``worker_lease`` and its descriptor handles."""
        leases = {g.memory.fd.handle for g in req.groups if g.memory.WhichOneof("kind") == "fd"}
        if req.worker_lease:
            if self._fd_lookup is None:
                raise InvalidArgumentError(
                    "worker_lease: this sidecar has no descriptor socket (it runs without --local-socket)",
                    field="worker_lease",
                )
            try:
                self._fd_lookup(req.worker_lease)
            except KeyError:
                raise InvalidArgumentError(
                    f"worker_lease: {req.worker_lease!r} is not an open lease on the descriptor socket (closed, or "
                    "never handed out by this sidecar)",
                    field="worker_lease",
                ) from None
            leases.add(req.worker_lease)
        return frozenset(leases)

    def lease_open(self, handle: str) -> bool:
        """True while the descriptor-socket connection behind ``handle`` is open."""
        if self._fd_lookup is None:
            return False
        try:
            self._fd_lookup(handle)
        except KeyError:
            return False
        return True

    def drop(self) -> Registration | None:
        """Forget the registration and release its memory (its worker is gone); returns it."""
        old, self.registration = self.registration, None
        self._identity = None
        self._regions_msg.clear()
        if old is not None:
            self.release(old.groups.values())
            self.metrics.registered_bytes.set(0)
        return old

    def _refuse_other_rank(self, worker: str, tp: int, pp: int, tp_size: int, pp_size: int) -> None:
        held = self.registration
        if held is None or (held.rank.tp_rank, held.rank.pp_rank) == (tp, pp):
            return
        # Two ranks sharing a sidecar would silently replace each other's memory: refuse the second.
        raise FailedPreconditionError(
            f"rank: this sidecar serves tp rank {held.rank.tp_rank}/{held.rank.tp_size} pp rank "
            f"{held.rank.pp_rank}/{held.rank.pp_size} (worker {held.worker_id!r}); worker {worker!r} "
            f"registered tp rank {tp}/{tp_size} pp rank {pp}/{pp_size}. One sidecar serves one worker rank: run one "
            "sidecar per rank",
            field="rank", reason=Reason.RANK_TAKEN,
        )  # fmt: skip

    def _attach_groups(
        self, req: local_pb2.RegisterCachesRequest, rank: Any, agent_pid: int | None
    ) -> dict[str, tuple[KVCacheLayout, AttachedMemory]]:
        """Check every group and map its memory (registering nothing); raises naming the field."""
        attached: dict[str, tuple[KVCacheLayout, AttachedMemory]] = {}
        try:
            for i, g in enumerate(req.groups):
                name = check_id(g.name, f"groups[{i}].name")
                if name in attached:
                    raise InvalidArgumentError(f"groups[{i}].name: group {name!r} given twice", field="groups")
                layout = layout_from_proto(g.layout, f"groups[{i}].layout")
                check_rank_heads(layout, rank, f"groups[{i}].layout")
                attached[name] = (layout, attach(memory_from_proto(g.memory, f"groups[{i}].memory"), layout,
                                                 field=f"groups[{i}].memory", fds=self._fd_lookup,
                                                 agent_pid=agent_pid))  # fmt: skip
        except BaseException:
            for _, memory in attached.values():
                memory.close()
            raise
        return attached

    def _register_groups(self, attached: dict[str, tuple[KVCacheLayout, AttachedMemory]]) -> dict[str, Group]:
        """Register the mapped groups with the data plane (all or none)."""
        groups: dict[str, Group] = {}
        try:
            for name, (layout, memory) in attached.items():
                handle = self.dp.register(memory.table, "VRAM" if memory.mem_type == "VRAM" else "DRAM")
                groups[name] = Group(name, layout, memory, handle)
        except BaseException:
            self.release(groups.values())
            for name, (_, memory) in attached.items():
                if name not in groups:
                    memory.close()
            raise
        return groups

    def release(self, groups: Iterable[Group]) -> None:
        """Deregister and unmap ``groups`` (the worker's memory itself stays the worker's)."""
        for g in groups:
            with contextlib.suppress(Exception):
                self.dp.deregister(g.dp_handle)
            g.memory.close()

    def close(self) -> None:
        """Release the registration (shutdown)."""
        if self.registration is not None:
            self.release(self.registration.groups.values())
            self.registration = None
