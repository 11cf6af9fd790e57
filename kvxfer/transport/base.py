"""The one interface the sidecar uses for a data plane.

A :class:`Transport` owns one agent of a transfer library. It registers the regions of a
:class:`~kvxfer.topology.RegionTable`, exports metadata that peers load, and moves (N, 3)
descriptor arrays (address, length, device id; uint64) as produced by
:meth:`kvxfer.topology.RankPlan.descriptors`. Transfers are awaited on the asyncio loop without
spinning a core, time out, can be cancelled, and may carry a notification that the peer receives
exactly once.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from kvxfer.errors import FailedPreconditionError, Reason
from kvxfer.topology import RegionTable
from kvxfer.transport.errors import (
    TransferTimeoutError,
    TransferUnfencedError,
    TransportError,
    UnfencedOp,
    describe_transfer,
)

__all__ = [
    "DEFAULT_FENCE_BUDGET_S",
    "UNFENCED_CANCEL",
    "MemType",
    "Notification",
    "Op",
    "Registration",
    "SameHostGather",
    "TransferResult",
    "Transport",
    "TransportConfig",
    "WorkerAgentInfo",
    "cancelled_unfenced",
    "mem_type",
    "unfenced_op",
]  # fmt: skip

log = logging.getLogger(__name__)

#: The message of the CancelledError a cancelled transfer raises when its operation was still in flight
#: after the fence budget (a cancel carries no reason otherwise): see :func:`cancelled_unfenced`.
UNFENCED_CANCEL = "kvxfer: cancelled while its data-plane operation was still in flight after the fence budget"


def cancelled_unfenced(exc: BaseException) -> bool:
    """Whether ``exc`` is the CancelledError of a transfer cancelled unfenced (its bytes may still land)."""
    return isinstance(exc, asyncio.CancelledError) and bool(exc.args) and exc.args[0] == UNFENCED_CANCEL


def unfenced_op(exc: BaseException) -> UnfencedOp | None:
    """The operation an unfenced failure or cancel left in flight (to watch for its end), else None."""
    if isinstance(exc, TransferUnfencedError):
        return exc.unfenced
    if cancelled_unfenced(exc):
        op = exc.args[1] if len(exc.args) > 1 else None
        return op if isinstance(op, UnfencedOp) else UnfencedOp("?", "", watched=False)
    return None


#: How long a failed or cancelled transfer waits, by default, for its operation to end (the fence).
DEFAULT_FENCE_BUDGET_S = 5.0

U64 = npt.NDArray[np.uint64]
Op = Literal["READ", "WRITE"]
MemType = Literal["DRAM", "VRAM"]


def mem_type(value: str) -> MemType:
    """A memory type as the wire carries it (``VRAM``; anything else is host memory)."""
    return "VRAM" if value == "VRAM" else "DRAM"


CudaGather = Literal["kernel", "copy-engine"]


@dataclass(frozen=True)
class TransportConfig:
    """Backend settings; each backend reads the fields that concern it.

    Fields the sidecar's settings set have the settings' names (``kvxfer serve --nixl-backends``
    is ``nixl_backends`` here); :meth:`kvxfer.config.Settings.transport_config` fills them.
    """

    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_progress_delay_us: int = 200  # progress-thread sleep; 0 spins a core per agent
    listen_host: str = "127.0.0.1"  # Mooncake: address this engine is reached at
    data_port: int = 0  # Mooncake: handshake port (0: pick one)
    mooncake_protocol: str = "tcp"  # Mooncake: tcp or rdma
    mooncake_device: str = ""  # Mooncake: RDMA devices (empty: auto)
    cuda_ipc_direct: bool = False  # same-host GPU READs by device copies (kvxfer.transport.cuda_ipc_direct)
    cuda_gather: CudaGather = "kernel"  # those copies: one gather launch ("kernel") or the copy engines
    # NIXL: DRAM transfers of at least this many bytes are posted from a thread of their own (0: never);
    # see NixlTransport. Below it the hand-off costs the event loop more than the copy does.
    nixl_thread_post_bytes: int = 4 << 20
    poll_min_s: float = 20e-6  # first completion poll; doubles up to poll_max_s
    poll_max_s: float = 2e-3
    # Mooncake: how long its own synchronous wait lasts (plus 1 s per GiB) before it gives up on a
    # silent peer; its waiting thread spins until then (Mooncake enforces at least 5).
    mooncake_transfer_timeout_s: int = 5
    # A transfer that failed or was cancelled is reported only once its operation has ended (the
    # library says done or failed), so that none of its bytes lands after the caller heard of it;
    # it waits at most this long for that, then reports TransferUnfencedError (a cancel: raises
    # CancelledError and counts it) and keeps the operation's handle (docs/transports.md).
    fence_budget_s: float = DEFAULT_FENCE_BUDGET_S

    def replace(self, **changes: Any) -> TransportConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Registration:
    """What :meth:`Transport.register` returns; hand it back to :meth:`Transport.deregister`."""

    table: RegionTable
    mem_type: MemType
    handle: Any


@dataclass(frozen=True)
class WorkerAgentInfo:
    """A data-plane agent in the worker's process (``--backend worker``), as its registration describes it."""

    backend: str  # the library it runs: a backend name such as "nixl"
    agent_name: str
    metadata: bytes  # what a peer's agent loads to reach it
    pid: int  # the worker's process: its memory's addresses are in it


@dataclass(frozen=True)
class TransferResult:
    """A completed transfer."""

    bytes: int
    descriptors: int
    seconds: float


@dataclass(frozen=True)
class SameHostGather:
    """A READ as a process on the publisher's host could run it itself (:meth:`Transport.same_host_gather`).

    ``handles``: the publishing worker's GPU allocations, their 64-byte CUDA IPC handles one after
    the other; ``device_uuids[i]``: the GPU holding allocation ``i``; per descriptor, the allocation
    it reads (``source``) and the byte offset in it (``offset``).
    """

    handles: bytes
    device_uuids: tuple[str, ...]
    source: U64
    offset: U64


@dataclass(frozen=True)
class Notification:
    """A completion notice a peer attached to its transfer."""

    peer: str
    message: bytes


class Transport(abc.ABC):
    """One agent of a data-plane library (see the module docstring)."""

    name: ClassVar[str]
    #: Whether same-host GPU READs may bypass this backend by device copies of the publisher's
    #: memory (:mod:`kvxfer.transport.cuda_ipc_direct`); needs the memory mapped in the sidecar.
    same_host_shortcut: ClassVar[bool] = True
    #: Whether the data plane runs in the worker's process (:meth:`bind_worker`; ``--backend worker``).
    in_worker: ClassVar[bool] = False
    #: Whether the library itself answers anyone who reaches its own ports with what a READ or WRITE
    #: needs (the addresses of the registered memory) and then serves those operations, no kvxfer
    #: credential asked: the data plane is then open beyond loopback whatever --token-file or TLS
    #: protect (Mooncake's P2P handshake). A sidecar starts one off loopback only with --insecure.
    serves_memory_openly: ClassVar[bool] = False

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        self.agent_name = agent_name
        self.config = config or TransportConfig()
        self._registered: list[RegionTable] = []  # what errors name as "local regions ..."
        #: Failed or cancelled transfers reported before their operation ended (the fence budget ran out).
        self.unfenced_total = 0
        #: Called with (op, peer) for each of them (the sidecar counts them: kvxfer_data_plane_unfenced_total).
        self.on_unfenced: Callable[[str, str], None] | None = None

    @classmethod
    def library_loggers(cls) -> tuple[str, ...]:
        """Names of the Python loggers the backend's library logs to, set up (the library imported)
        so that an application can replace their handlers before a first agent logs; none by default."""
        return ()

    @property
    def backend(self) -> str:
        """The registry name of this transport."""
        return self.name

    def _describe(self, op: str, local: U64, remote: U64) -> str:
        """The transfer in words, for error messages: sizes, local regions, address ranges."""
        return describe_transfer(op, self._registered, local, remote)

    def unfenced_live(self) -> int:
        """Operations reported as failed that the library has not yet seen end (their handles are kept).

        Asking looks again: each of them that ended since gets ``UnfencedOp.ended``."""
        return 0

    def _count_unfenced(self, op: str, peer: str) -> None:
        self.unfenced_total += 1
        log.warning("%s: %s of peer %r reported failed while still in flight after the fence budget (%.3gs); its "
                    "bytes may still land", self.name, op, peer, self.config.fence_budget_s)  # fmt: skip
        if self.on_unfenced is not None:
            self.on_unfenced(op, peer)

    def _end_failed(
        self, op: str, peer: str, failure: TransportError | None, *, cancelled: bool, ended: bool, in_flight: str,
        unfenced: UnfencedOp | None = None,
    ) -> NoReturn:  # fmt: skip
        """Raise what a failed or cancelled transfer ends in, once the fence is over.

        ``ended``: the library said the operation ended (the failure, or the cancel, as it came);
        otherwise it is counted unfenced and the error says so (``in_flight`` names what was still in
        flight), and a cancel carries :data:`UNFENCED_CANCEL`. Either carries ``unfenced``, the handle
        this transport watches until the operation ends (see :func:`unfenced_op`).
        """
        if not ended:
            self._count_unfenced(op, peer)
            unfenced = unfenced or UnfencedOp(op, peer, watched=False)
        if cancelled:
            raise asyncio.CancelledError if ended else asyncio.CancelledError(UNFENCED_CANCEL, unfenced)
        assert failure is not None
        if ended:
            raise failure
        raise TransferUnfencedError(
            f"{failure.what}; {in_flight} still in flight after the fence budget ({self.config.fence_budget_s:.3g}s), "
            "so its bytes may still land",
            backend=self.name,
            peer=peer,
            detail=failure.detail,
            timed_out=isinstance(failure, TransferTimeoutError),
            unfenced=unfenced,
        ) from None

    def _track(self, table: RegionTable) -> None:
        self._registered.append(table)

    def _untrack(self, table: RegionTable) -> None:
        self._registered = [t for t in self._registered if t is not table]

    def bind_worker(self, info: WorkerAgentInfo | None) -> None:
        """The worker's own agent registered (or went away: None); only :attr:`in_worker` backends take one."""
        if info is not None:
            raise FailedPreconditionError(
                f"worker_agent: the worker registered an agent of its own ({info.backend} {info.agent_name!r}), but "
                f"this sidecar's data plane ({self.name}) runs in the sidecar: start it with --backend worker, or let "
                "the worker register without one",
                field="worker_agent", reason=Reason.WRONG_BACKEND,
            )  # fmt: skip

    @abc.abstractmethod
    def register(self, table: RegionTable, mem_type: MemType = "DRAM") -> Registration:
        """Register every region of ``table`` so peers can reach it."""

    @abc.abstractmethod
    def deregister(self, registration: Registration) -> None:
        """Undo :meth:`register`; peers lose access."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to :meth:`add_peer` to reach this agent (call after registering)."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer name. Reloading (a restarted peer) replaces it."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer; unknown peers are ignored."""

    @abc.abstractmethod
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
        """READ ``remote`` into ``local`` (or WRITE ``local`` to ``remote``) on ``peer``.

        Raises :class:`~kvxfer.transport.errors.TransferTimeoutError` after ``timeout`` seconds,
        :class:`~kvxfer.transport.errors.TransferFailedError` when the library reports an error.
        Cancelling the awaiting task cancels the transfer. Fence: an error (or the cancel) is raised
        only once the library says the operation ended, so no byte of it lands afterwards; when that
        takes longer than ``config.fence_budget_s`` the error is a
        :class:`~kvxfer.transport.errors.TransferUnfencedError` (a cancel stays a CancelledError and
        is counted in :attr:`unfenced_total`), and the operation's handle is kept until it ends
        (docs/transports.md, "What a cancel or a timeout guarantees").
        """

    async def read(
        self,
        peer: str,
        local: U64,
        remote: U64,
        *,
        timeout: float = 30.0,
        notify: bytes | None = None,
        mem_type: MemType = "DRAM",
        remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:
        """Shorthand for a READ (pull)."""
        return await self.transfer(
            "READ", local, remote, peer, timeout=timeout, notify=notify, mem_type=mem_type,
            remote_mem_type=remote_mem_type,
        )  # fmt: skip

    def same_host_gather(
        self, peer: str, local: U64, remote: U64, *, mem_type: MemType, remote_mem_type: MemType
    ) -> SameHostGather | None:
        """This READ as allocations another process on this host can open, or None when it is not one.

        The worker then moves the bytes in its own CUDA context (``PullRequest.worker_gather``).
        Only a backend that reads peers' memory by CUDA IPC can say yes; raises
        :class:`~kvxfer.transport.errors.TransferFailedError` on a descriptor outside the peer's regions.
        """
        return None

    @abc.abstractmethod
    def poll_notifications(self) -> list[Notification]:
        """Notifications received since the last call, each returned once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the agent and everything it registered."""


def check_descriptors(local: U64, remote: U64) -> tuple[U64, U64]:
    """Validate a pair of (N, 3) uint64 descriptor arrays; returns them contiguous."""
    local = np.ascontiguousarray(local, dtype=np.uint64)
    remote = np.ascontiguousarray(remote, dtype=np.uint64)
    if local.ndim != 2 or local.shape[1] != 3 or remote.shape != local.shape:
        raise ValueError(f"descriptors: expected two (N, 3) arrays of one shape, got {local.shape} and {remote.shape}")
    if not (local[:, 1] == remote[:, 1]).all():  # np.array_equal's checks cost more than the comparison
        raise ValueError("descriptors: local and remote lengths differ")
    return local, remote
