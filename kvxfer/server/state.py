"""The sidecar's bookkeeping: registered caches, published requests (leases), pulls in flight and the
offers held as a writer (push mode)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxfer.layout import KVCacheLayout
from kvxfer.memory import AttachedMemory
from kvxfer.server.identity import Identity
from kvxfer.server.validation import TokenSpans
from kvxfer.topology import RankInfo
from kvxfer.transport import UnfencedOp

if TYPE_CHECKING:  # prepared.py reads Registration from here
    from kvxfer.server.prepared import PreparedPull

__all__ = ["Grant", "Group", "Offer", "PublishEntry", "PullEntry", "ReaderKey", "Registration"]

I64 = npt.NDArray[np.int64]
ReaderKey = tuple[str, str, int, int]  # engine id, instance id, tp rank, pp rank


@dataclass
class Group:
    """One registered cache group."""

    name: str
    layout: KVCacheLayout
    memory: AttachedMemory
    dp_handle: Any


@dataclass
class Registration:
    """What the worker registered."""

    worker_id: str
    rank: RankInfo
    groups: dict[str, Group]
    epoch: int
    #: Descriptor-socket handles whose closing means the worker is gone (see RegisterCaches.worker_lease).
    leases: frozenset[str] = frozenset()

    @property
    def layouts(self) -> dict[str, KVCacheLayout]:
        """Layouts by group name, in registration order."""
        return {n: g.layout for n, g in self.groups.items()}

    @property
    def nbytes(self) -> int:
        """Registered bytes."""
        return sum(g.memory.nbytes for g in self.groups.values())


@dataclass
class PublishEntry:
    """A published request held under a lease."""

    request_id: str
    blocks: dict[str, I64]
    lease_seconds: float
    expires_at: float  # time.monotonic()
    timer: asyncio.TimerHandle | None = None
    expected_readers: set[int] | None = None  # reader TP ranks that must confirm
    reader_tp_size: int = 0
    readers: dict[ReaderKey, str] = field(default_factory=dict)  # who fetched it -> their address
    done_readers: set[int] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    #: The reader engine allowed to fetch, notify or abort it ('' until named or first touched).
    reader_engine: str = ""
    published_at: float = 0.0  # time.monotonic(): holds never extend past published_at + --max-hold-seconds
    #: Per group: the request's token position of the first published block (push offers name positions).
    origins: dict[str, int] = field(default_factory=dict)

    @property
    def expires_unix_ms(self) -> int:
        """Expiry as wall-clock milliseconds."""
        return int((time.time() + self.expires_at - time.monotonic()) * 1000)


@dataclass(frozen=True)
class Grant:
    """A publisher's promise (answer to a peer Hold): it holds these blocks until ``valid_until``.

    ``valid_until`` is on this side's monotonic clock, counted from when the Hold was *sent* (the
    publisher answered later), so no clock needs to agree across hosts. Good only with the regions
    of the handshake of that publisher instance and registration epoch.
    """

    valid_until: float
    instance_id: str
    epoch: int
    blocks: dict[str, I64]


#: A publisher's answer to a request's first Hold, as a pull waits for it (None: no grant came).
Due = asyncio.Future[Grant | None]


@dataclass
class PullEntry:
    """A pull in flight."""

    transfer_id: str
    request_id: str
    remote_engine_id: str
    addresses: list[str]
    deadline: float  # time.monotonic()
    started: float
    task: asyncio.Task[None] | None = None
    #: Per group: (num_tokens or None for all, local skip, remote skip) in tokens (see BlockList).
    spans: dict[str, tuple[int | None, int, int]] = field(default_factory=dict)
    posted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    abort_reason: str | None = None
    #: A READ of it ended cancelled (the pull's deadline, an abort) while its data-plane operation was
    #: still in flight after the fence budget, or (push) a writer's Revoke answered that a WRITE of it
    #: was: its bytes may still land (reason DATA_PLANE_UNFENCED).
    unfenced: bool = False
    #: The data-plane operations its failed READs left in flight (kvxfer.server.unsettled watches them).
    unfenced_ops: list[UnfencedOp] = field(default_factory=list)
    abort_from_peer: bool = False
    stage: str = "starting"
    contacted: list[str] = field(default_factory=list)  # addresses that handed out the request
    asked: list[str] = field(default_factory=list)  # addresses asked for it (answered or not): aborts go there
    unread: list[str] = field(default_factory=list)  # remote ranks no local rank reads (replicas)
    grants: dict[str, Grant] = field(default_factory=dict)  # by publisher address (see kvxfer.server.holds)
    #: The answers still due to the request's first Holds when the pull started, by address (kvxfer.server.holds).
    grants_due: dict[str, Due] = field(default_factory=dict)
    #: Push mode (kvxfer.server.push_steps): the sources WRITE; each one's Landed notice, by address.
    push: bool = False
    #: Push mode: the worker's (local_blocks, remote_blocks) lists, as the offers carry them.
    offer: tuple[list[Any], list[Any]] = field(default_factory=lambda: ([], []))
    landed: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    writers: dict[str, Any] = field(default_factory=dict)  # address -> the Identity of its handshake
    #: A Pull call waits for the outcome: it does the bookkeeping of a success once it has answered.
    waited: bool = False
    #: A success's bookkeeping (metrics, completion event, the publishers' notice): (stats, seconds), then done.
    unbooked: tuple[Any, float] | None = None
    #: PullRequest.worker_gather: the worker moves the bytes when the pull is one same-host GPU gather.
    #: ``handoff`` (set only then) gets the gather (local_pb2.WorkerGather) for the Pull call to
    #: answer with, ``gathered`` the worker's report (local_pb2.GatherDoneRequest).
    handoff: asyncio.Future[Any] | None = None
    gathered: asyncio.Future[Any] | None = None
    #: The plan a Prepare made for this Pull (kvxfer.server.prepared), until the READs take it.
    prepared: PreparedPull | None = None


@dataclass
class Offer:
    """One reader rank's blocks for one request, waiting for (or being written by) this rank."""

    transfer_id: str
    request_id: str
    key: ReaderKey
    reader: Identity
    rank: RankInfo
    blocks: dict[str, I64]
    spans: TokenSpans
    writer_given: dict[str, I64]
    deadline: float  # time.monotonic()
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None
    wrote: bool = False  # a WRITE was started
    revoked: bool = False
    #: A WRITE of it ended unfenced (failed or cancelled while still in flight after the fence budget):
    #: its bytes may still land in the reader's blocks, which its reader must hear (DATA_PLANE_UNFENCED).
    unfenced: bool = False
    #: Layer-wise push (kvxfer.server.streamer): per (group, layer), the WRITE in flight or last done,
    #: and the request position up to which that layer is written.
    stream_tasks: dict[tuple[str, int], asyncio.Task[None]] = field(default_factory=dict)
    streamed: dict[tuple[str, int], int] = field(default_factory=dict)
    stream_bytes: int = 0
    stream_descriptors: int = 0
    stream_seconds: float = 0.0
    stream_failed: bool = False

    def covered(self, group: str, num_layers: int) -> bool:
        """Every layer of ``group`` was streamed up to the offer's last token."""
        num_tokens, _skip, at = self.spans.get(group, (None, 0, 0))
        if num_tokens is None or self.stream_failed:
            return False
        return all(self.streamed.get((group, layer), at) >= at + num_tokens for layer in range(num_layers))

    def cancel_streams(self) -> list[asyncio.Task[None]]:
        """Cancel the layer WRITEs in flight; returns them (to wait for)."""
        running = [t for t in self.stream_tasks.values() if not t.done()]
        for t in running:
            t.cancel()
        return running
