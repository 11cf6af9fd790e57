"""Step 4 of a pull (:mod:`kvxfer.server.pull_steps`): its READs, from every source rank at once over the data plane.

:class:`PullReads` posts one READ per remote rank and waits for all of them under the pull's
deadline; a confirmed same-host READ of one source rank may be handed to the worker as a gather
instead (:mod:`kvxfer.server.worker_gathers`). A READ's failure becomes a typed error with its reason;
one that may still land after the fence budget (``DATA_PLANE_UNFENCED``) leaves its operation on the
pull, which :mod:`kvxfer.server.puller` and :mod:`kvxfer.server.unsettled` watch until it ended.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import DeadlineError, KvxferError, PeerUnavailableError, Reason
from kvxfer.server.lookups import Fetched
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.state import PullEntry, Registration
from kvxfer.server.worker_gathers import WorkerGathers
from kvxfer.transport import Transport, mem_type, unfenced_op

__all__ = ["PullReads"]

U64 = npt.NDArray[np.uint64]


class PullReads:
    """The READs of a pull (see the module docs); holds nothing between pulls."""

    def __init__(self, data_plane: Transport, peers: PeerDirectory, worker: WorkerGathers) -> None:
        self.dp = data_plane
        self.peers = peers
        #: READs handed to the worker as gathers (PullRequest.worker_gather).
        self.worker = worker

    async def read_all(
        self, entry: PullEntry, reg: Registration, per_rank: dict[int, list[tuple[U64, U64]]],
        published: dict[int, Fetched], sessions: dict[int, PeerSession], *, confirmed: bool = True,
    ) -> tuple[int, int, float]:  # fmt: skip
        """READ from every remote rank at once; returns (bytes, descriptors, seconds of data movement).

        ``confirmed``: the publishers confirmed these blocks already (a grant, a lookup's answer), as
        opposed to lookups still running beside the READs (only a confirmed READ goes to the worker).
        """
        entry.stage = "reading from " + ", ".join(f"rank {q} ({entry.addresses[q]})" for q in per_rank)
        total_bytes = total_desc = 0
        reads = []
        mem_type = next(iter(reg.groups.values())).memory.mem_type
        for q, parts in per_rank.items():
            if not parts:
                continue
            local = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            remote = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            total_bytes += int(local[:, 1].sum())
            total_desc += int(local.shape[0])
            reads.append((sessions[q], local, remote, published[q].mem_type))
        # The worker moves a pull that is one same-host gather (one source rank) itself, if it asked
        # to, once the publishers confirmed the blocks: reading ahead of the lookups, the READ is the
        # sidecar's, which overlaps them (a worker's gather would add its report's round trip to them).
        by_worker = confirmed and entry.handoff is not None and not entry.handoff.done() and len(reads) == 1
        t0 = time.monotonic()
        if not entry.posted.done():
            entry.posted.set_result(None)
        await _gather_or_cancel([self._read(entry, reg, *r, mem_type, by_worker=by_worker) for r in reads])
        return total_bytes, total_desc, time.monotonic() - t0

    async def _read(
        self, entry: PullEntry, reg: Registration, s: PeerSession, local: U64, remote: U64, rmem: str, mem: str, *,
        by_worker: bool = False,
    ) -> None:  # fmt: skip
        if by_worker:
            try:
                gather = self.dp.same_host_gather(s.dp_name, local, remote, mem_type=mem_type(mem),
                                                  remote_mem_type=mem_type(rmem))  # fmt: skip
            except KvxferError as exc:
                raise PeerUnavailableError(
                    f"data plane READ from {s.identity.label} at {s.address} failed: {exc.message}",
                    field="remote_addresses", reason=Reason.DATA_PLANE,
                ) from None  # fmt: skip
            # False: the worker could not start it (nothing was copied), so this sidecar moves the bytes.
            if gather is not None and await self.worker.hand_over(entry, reg, s, gather, local):
                return
        # Taken now (after any handoff): the READ must end by the deadline, which the grants clamp.
        remaining = max(entry.deadline - time.monotonic(), 0.001)
        try:
            await self.dp.read(s.dp_name, local, remote, timeout=remaining, mem_type=mem_type(mem),
                               remote_mem_type=mem_type(rmem))  # fmt: skip
        except asyncio.CancelledError as exc:
            _note_unfenced(entry, exc)
            raise
        except KvxferError as exc:
            self.peers.invalidate(s.address, reconnect=True, session=s)
            _note_unfenced(entry, exc)
            if exc.reason == Reason.DATA_PLANE_UNFENCED:
                # The READ was still in flight after the fence budget: its bytes may still land in these
                # blocks, which the worker must not hand to another request until it knows they stopped.
                raise PeerUnavailableError(
                    f"data plane READ from {s.identity.label} at {s.address} failed and may still land: "
                    f"{exc.message}",
                    field="remote_addresses", reason=Reason.DATA_PLANE_UNFENCED,
                ) from None  # fmt: skip
            if exc.status == "DEADLINE_EXCEEDED":
                raise DeadlineError(
                    f"data plane READ from {s.identity.label} at {s.address} did not finish within {remaining:.3g}s "
                    f"(while {entry.stage}): {exc.message}",
                    field="timeout_seconds",
                ) from None
            raise PeerUnavailableError(
                f"data plane READ from {s.identity.label} at {s.address} failed: {exc.message}",
                field="remote_addresses", reason=Reason.DATA_PLANE,
            ) from None  # fmt: skip


def _note_unfenced(entry: PullEntry, exc: BaseException) -> None:
    """Keep on the pull what a READ's unfenced failure or cancel left in flight. The pull's error says so
    however it ends (pull_failures.pull_failure): a READ again that fails too, or a sibling READ's failure that the
    task group reports first; and the sidecar watches it until it ended (kvxfer.server.unsettled)."""
    if (unfenced := unfenced_op(exc)) is not None:
        entry.unfenced = True
        entry.unfenced_ops.append(unfenced)


async def _gather_or_cancel(coros: list[Any]) -> None:
    """Run all; on the first failure cancel the rest and raise it.

    A task group takes a child that ended cancelled for one that ended well. A READ cancelled by
    anything but this pull (a backend that cancels its own waits) moved nothing for sure, so it
    fails the pull instead of leaving its bytes unmoved under a pull that reports success.
    """
    if len(coros) == 1:
        try:
            await coros[0]
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is None or me.cancelling():
                raise
            raise _cancelled_reads(1, 1) from None
        return
    tasks: list[asyncio.Task[Any]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise _first_failure(group) from None
    cancelled = sum(t.cancelled() for t in tasks)
    if cancelled:
        raise _cancelled_reads(cancelled, len(tasks))


def _cancelled_reads(cancelled: int, of: int) -> PeerUnavailableError:
    return PeerUnavailableError(
        f"{cancelled} of {of} data plane READs ended cancelled although the pull was not: their bytes may be missing",
        field="remote_addresses", reason=Reason.DATA_PLANE,
    )  # fmt: skip


def _first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real failure of a task group, not the group (the others were cancelled because of it)."""
    return next((e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)), group.exceptions[0])
