"""READs handed to the decode worker as one gather each (``PullRequest.worker_gather``).

A pull that comes down to one same-host GPU gather, whose blocks the publishers confirmed, can be
moved by the worker itself, in its own CUDA context (:mod:`kvxfer.client.gather`). The pull's steps
(:mod:`kvxfer.server.pull_steps`) decide when; :class:`WorkerGathers` does the handing over: the
spans in the worker's terms (its registered regions), the ticket, the wait for its ``GatherDone``
and what that report means for the pull. The Pull call answers with the gather
(``PullEntry.handoff``); :mod:`kvxfer.server.puller` takes the reports.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import DeadlineError, InvalidArgumentError, PeerUnavailableError, Reason
from kvxfer.logs import get_logger
from kvxfer.server.peers import PeerSession
from kvxfer.server.state import PullEntry, Registration
from kvxfer.topology import RegionIndex
from kvxfer.transport import SameHostGather
from kvxfer.wire import local_pb2

__all__ = ["WorkerGathers"]

log = get_logger("kvxfer.server")

U64 = npt.NDArray[np.uint64]


class WorkerGathers:
    """The gathers handed to this sidecar's worker and not reported yet, by ticket."""

    def __init__(self) -> None:
        self.waiting: dict[int, PullEntry] = {}
        self._tickets = itertools.count(1)
        self._regions: _Regions | None = None  # of the registration last read into by the worker

    async def hand_over(
        self, entry: PullEntry, reg: Registration, s: PeerSession, gather: SameHostGather, local: U64
    ) -> bool:
        """Hand the READ to the worker as one gather (the Pull call answers with it) and wait for its report.

        False: the worker could not start it (it copied nothing), and the caller READs instead.

        The worker launches it in its own CUDA context, as soon as the answer reaches it: no
        sidecar launch, no GPU context switch. It must see the copies end by ``entry.deadline``
        (on the host's monotonic clock, which both processes read), while the publishers' promise
        holds; a report that it did not, or none by then, fails the pull.
        """
        assert entry.handoff is not None
        if self._regions is None or self._regions.epoch != reg.epoch:
            self._regions = _Regions.of(reg)
        region, offset = _worker_regions(self._regions, local)
        spans = np.column_stack((gather.source, gather.offset, region, offset, local[:, 1].astype(np.uint64)))
        ticket = next(self._tickets)
        loop = asyncio.get_running_loop()
        entry.gathered = loop.create_future()
        self.waiting[ticket] = entry
        handed = time.monotonic()  # the copies cannot end before the worker is handed them
        try:
            entry.handoff.set_result(local_pb2.WorkerGather(
                ticket=ticket, spans=np.ascontiguousarray(spans, dtype="<u8").tobytes(), deadline=entry.deadline,
                source_handles=gather.handles, source_devices=gather.device_uuids,
            ))  # fmt: skip
            report: local_pb2.GatherDoneRequest = await entry.gathered
        finally:
            self.waiting.pop(ticket, None)
        if not report.ok and not report.launched:
            log.warning("the worker could not start a gather; this sidecar moves the bytes",
                        extra={"peer": s.identity.label, "error": report.error})  # fmt: skip
            return False
        if not report.ok:
            raise PeerUnavailableError(
                f"the worker's gather of the READ from {s.identity.label} at {s.address} failed: {report.error}",
                field="remote_addresses", reason=Reason.DATA_PLANE,
            )  # fmt: skip
        if not (math.isfinite(report.ended) and report.ended >= handed):
            # NaN or unset (0) would pass the deadline check below: no success without a time it ended.
            raise InvalidArgumentError(
                f"ended: the worker's gather of the READ from {s.identity.label} at {s.address} reports it ended at "
                f"{report.ended!r}, not a CLOCK_MONOTONIC time after it was handed out ({handed:.6f}); the pull fails",
                field="ended",
            )  # fmt: skip
        if report.ended > entry.deadline:
            raise DeadlineError(
                f"the worker's gather of the READ from {s.identity.label} at {s.address} ended "
                f"{(report.ended - entry.deadline) * 1e3:.3g} ms after the pull's deadline", field="timeout_seconds",
            )  # fmt: skip
        return True


@dataclass(frozen=True)
class _Regions:
    """A registration's regions in the worker's order (groups in registration order, regions in
    layout order: the order the worker registered its tensors), searchable by address here."""

    epoch: int
    index: RegionIndex

    @classmethod
    def of(cls, reg: Registration) -> _Regions:
        tables = [g.memory.table for g in reg.groups.values()]
        bases, sizes = np.concatenate([t.base for t in tables]), np.concatenate([t.size for t in tables])
        return cls(reg.epoch, RegionIndex.of(bases, sizes))


def _worker_regions(regions: _Regions, local: U64) -> tuple[U64, U64]:
    """Per local descriptor, the worker's region it lies in and its byte offset there."""
    addr = local[:, 0].astype(np.uint64, copy=False)
    region, inside = regions.index.find(addr, local[:, 1])
    if not inside.all():
        raise RuntimeError("a local descriptor lies outside the registered regions")  # a planning bug
    return region.astype(np.uint64), addr - regions.index.bases[region]
