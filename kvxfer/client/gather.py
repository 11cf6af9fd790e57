"""The worker moving a pull's bytes itself: one gather launch in its own CUDA context.

On one host a sidecar READs a publisher's GPU memory with one gather launch (:mod:`kvxfer.cuda_gather`)
in its own process. What that costs beyond the bytes is mostly the sidecar's: its thread waking,
its driver calls, and the GPU switching to its context (docs/notes/gpu.md, runs 19-24). A worker
that asks for it (``PullRequest.worker_gather``) is instead handed the pull as one gather
(``PullResponse.gather``: the publishing worker's allocations by CUDA IPC handle, and spans as
offsets in them and in this worker's registered regions) and launches it itself, right after the
answer arrives, in the context that owns the destination. The sidecar keeps everything else:
authentication, grants and leases, lookups, descriptors, the publishers' notices.

The gather must end by its ``deadline`` (the host's monotonic clock, which both processes read:
the publishers hold the blocks until then), and the sidecar hands one out only once the publishers
confirmed its blocks (a grant, or a lookup's answer): a gather that ended in time is the pull's
success, and its report (``GatherDone``) goes in the background. A gather the worker could not start
(an allocation it cannot map) is moved by the sidecar instead; the worker then waits for
GatherDone's answer, the pull's outcome, and asks for no more gathers.

Use::

    gather = WorkerGather.from_tensors(0, {"attn": kv_tensors})  # the groups as registered, in order
    result = client.pull(rid, addresses, blocks, remote_blocks=ids, gather=gather)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer import cuda_ipc
from kvxfer.client.types import KvxferRpcError, PullResult
from kvxfer.errors import InvalidArgumentError, Reason
from kvxfer.logs import get_logger
from kvxfer.wire import local_pb2

__all__ = ["ANSWER_SPIN_S", "GatherOutcome", "WorkerGather", "report_lost", "settled"]

log = get_logger("kvxfer.client.gather")

U64 = npt.NDArray[np.uint64]

#: How long the worker's thread polls the gather's event before sleeping in the driver for it: a
#: same-host gather mostly ends within it (1 GiB at 2 TB/s: 0.5 ms).
SPIN_S = 0.002

#: How long a worker that may be handed a gather polls for the sidecar's answer without sleeping,
#: after its warm-up: the answer mostly comes within it (0.5-2.5 ms on the lent H200), and a thread
#: that slept meanwhile would run the gather's code cold again (docs/notes/gpu.md, runs 35-38).
ANSWER_SPIN_S = 0.003

#: Publishers' allocation sets (one per publishing worker and registration) kept mapped between
#: pulls. Mapping one costs milliseconds; one that is no longer used (its worker re-registered or
#: exited) must not stay mapped for the life of this worker. Same-host publishers are a node's few.
MAX_SOURCE_SETS = 16

_Key = tuple[int, bytes]  # (device ordinal, CUDA IPC handle): one use of a mapping in cuda_ipc.mappings


@dataclass
class _SourceSet:
    """One publisher's allocations as mapped here, and who still needs them."""

    bases: U64  # where each allocation is mapped here
    keys: tuple[_Key, ...]  # the mappings, each to be given back once
    gathers: int = 0  # gathers copying from them now
    kept: bool = True  # among the MAX_SOURCE_SETS most recently used


@dataclass(frozen=True)
class _Launched:
    """A gather on its way: what to wait on, what it moves, and when each phase began."""

    batch: Any
    sizes: U64
    sources: _SourceSet
    t0: float  # the plan began
    t1: float  # the launch began
    t2: float  # launched

    def failed(self, exc: cuda_ipc.CudaIpcError) -> GatherOutcome:
        return GatherOutcome(False, f"device copies failed: {exc.message}", time.monotonic(),
                             time.perf_counter() - self.t0, 0, int(self.sizes.size))  # fmt: skip


@dataclass(frozen=True)
class GatherOutcome:
    """How a gather this worker ran ended."""

    ok: bool
    error: str
    ended: float  # time.monotonic() when its end was seen
    seconds: float  # launch to end seen
    bytes: int
    spans: int
    late: bool = False  # the copies ended, past the deadline
    launched: bool = True  # False: nothing was copied (the sidecar then moves the bytes)

    def report(self, ticket: int) -> local_pb2.GatherDoneRequest:
        """The ``GatherDone`` request that reports it."""
        return local_pb2.GatherDoneRequest(ticket=ticket, ok=self.ok, error=self.error, ended=self.ended,
                                           launched=self.launched)  # fmt: skip


class WorkerGather:
    """Runs the gathers a sidecar hands this worker (see the module docs).

    ``device``: the ordinal of the GPU holding this worker's KV cache; ``regions``: the base address
    of every region this worker registered, groups in registration order and each group's regions
    in layout order (one tensor per layer: the order ``CudaIpcRef.from_tensors`` was given them).
    """

    def __init__(self, device: int, regions: Sequence[int], *, warm_up: bool = True) -> None:
        self.device = int(device)
        #: Run :meth:`warm_up` while a pull waits for its answer (the clients do).
        self.warm = warm_up
        self.regions: U64 = np.asarray([int(r) for r in regions], dtype=np.uint64)
        # A plan's source_handles -> (each one's base here, the mappings kept for it), least
        # recently used first. Guarded by _lock: blocking clients may run gathers from several threads.
        self._sources: OrderedDict[bytes, _SourceSet] = OrderedDict()
        self._lock = threading.Lock()
        #: Why a gather could not be started here (an allocation this process cannot map: the
        #: publisher in this very process, no peer access...); set, no more gathers are asked for.
        self.unusable = ""
        #: Where the last pull's time went, in microseconds (benchmarks): ``answer`` (the Pull call
        #: until its answer arrived; set by the client), ``plan`` (spans to addresses), ``launch``
        #: (the launch call), ``wait`` (launched until the end was seen).
        self.last: dict[str, float] = {}

    @classmethod
    def from_tensors(cls, device: int, groups: Mapping[str, Sequence[Any]], *, warm_up: bool = True) -> WorkerGather:
        """From the tensors registered per group (torch tensors: ``data_ptr()``), in registration order."""
        return cls(device, [int(t.data_ptr()) for tensors in groups.values() for t in tensors], warm_up=warm_up)

    def warm_up(self) -> None:
        """Run a gather's code on nothing that matters, while the pull's answer is on its way.

        The answer of a pull that asked for a gather takes the sidecar's planning (0.5-2 ms); the
        worker's thread would sleep meanwhile, and on the lent machines the code that runs after it
        woke (reading the plan, the table, the launch) then ran 3-8x slower than warm: 0.3 ms of a
        pull's fixed cost (docs/notes/gpu.md, runs 35-38). This reads a canned one-span plan the
        way :meth:`_launch` reads one and runs one 16-byte gather between two scratch bytes of this
        worker's GPU (:meth:`kvxfer.cuda_driver.CudaDriver.rehearse`). A failure here is logged once
        and changes nothing else: the pull's own gather reports its own errors.
        """
        if not self.warm or self.unusable:
            return
        try:
            _source, _src_off, region, dst_off, _sizes = _spans(_CANNED_SPANS)
            _ = self.regions[region] + dst_off  # as _addresses places a span (IndexError: no regions)
            cuda_ipc.driver().rehearse(self.device)
        except (cuda_ipc.CudaIpcError, IndexError) as exc:
            self.warm = False
            log.warning("a gather's warm-up failed; pulls go on without it", extra={"error": str(exc)})

    def run(self, plan: local_pb2.WorkerGather) -> GatherOutcome:
        """Launch ``plan`` on this worker's GPU and wait until it ended (or failed), in this thread."""
        launched = self._launch(plan)
        if isinstance(launched, GatherOutcome):
            return launched
        try:
            if not self._spin(launched):
                cuda_ipc.driver().wait(launched.batch)
            return self._ended(plan, launched)
        except cuda_ipc.CudaIpcError as exc:
            return launched.failed(exc)
        finally:  # the copies ended (or failed): the sources may go once no longer kept
            self._unpin(launched.sources)

    async def run_async(self, plan: local_pb2.WorkerGather) -> GatherOutcome:
        """:meth:`run` for an event loop: the launch follows the answer at once in the loop's thread,
        which polls the end for up to ``SPIN_S``; copies that take longer are waited for on a worker
        thread, so that the loop serves other calls meanwhile."""
        launched = self._launch(plan)
        if isinstance(launched, GatherOutcome):
            return launched
        try:
            if not self._spin(launched):
                await asyncio.to_thread(cuda_ipc.driver().wait, launched.batch)
            return self._ended(plan, launched)
        except cuda_ipc.CudaIpcError as exc:
            return launched.failed(exc)
        finally:
            self._unpin(launched.sources)

    def _launch(self, plan: local_pb2.WorkerGather) -> _Launched | GatherOutcome:
        """The gather launched (its sources pinned), or why it could not start (nothing pinned)."""
        t0 = time.perf_counter()
        try:
            dst, src, sizes, sources = self._addresses(plan)
        except (InvalidArgumentError, cuda_ipc.CudaIpcError) as exc:
            return self._not_started(f"the gather cannot run here: {exc.message}")
        t1 = time.perf_counter()
        try:
            batch = cuda_ipc.driver().copy_async(self.device, dst, src, sizes, kernel=True)
        except cuda_ipc.CudaIpcError as exc:
            self._unpin(sources)
            return self._not_started(f"the gather did not start: {exc.message}")
        return _Launched(batch, sizes, sources, t0, t1, time.perf_counter())

    @staticmethod
    def _spin(launched: _Launched) -> bool:
        """Poll the end for up to SPIN_S; True once it ended."""
        drv = cuda_ipc.driver()
        until = launched.t2 + SPIN_S
        while not drv.done(launched.batch):
            if time.perf_counter() > until:
                return False
        return True

    def _ended(self, plan: local_pb2.WorkerGather, launched: _Launched) -> GatherOutcome:
        ended = time.monotonic()
        t0, t1, t2, t3 = launched.t0, launched.t1, launched.t2, time.perf_counter()
        self.last.update(plan=(t1 - t0) * 1e6, launch=(t2 - t1) * 1e6, wait=(t3 - t2) * 1e6)
        sizes = launched.sizes
        nbytes = int(sizes.sum())
        if ended > plan.deadline:
            return GatherOutcome(False, f"the copies ended {(ended - plan.deadline) * 1e3:.3g} ms after the deadline",
                                 ended, t3 - t0, nbytes, int(sizes.size), late=True)  # fmt: skip
        return GatherOutcome(True, "", ended, t3 - t0, nbytes, int(sizes.size))

    @property
    def usable(self) -> bool:
        """False once a gather could not be started here: pulls then leave the bytes to the sidecar."""
        return not self.unusable

    def _not_started(self, why: str) -> GatherOutcome:
        if not self.unusable:
            log.warning("this worker cannot run the sidecar's gathers; its sidecar moves the bytes from now on",
                        extra={"error": why})  # fmt: skip
        self.unusable = why
        return GatherOutcome(False, why, time.monotonic(), 0.0, 0, 0, launched=False)

    def _addresses(self, plan: local_pb2.WorkerGather) -> tuple[U64, U64, U64, _SourceSet]:
        """(destinations, sources, sizes) of ``plan`` as addresses in this process, and its sources
        as mapped here, pinned until the caller's :meth:`_unpin`."""
        if len(plan.spans) % 40:
            raise InvalidArgumentError(f"gather.spans: {len(plan.spans)} bytes is not a whole number of 40-byte spans",
                                       field="gather.spans")  # fmt: skip
        spans = _spans(plan.spans)
        source, src_off, region, dst_off, sizes = spans
        handles, devices = plan.source_handles, plan.source_devices
        n = len(handles) // cuda_ipc.HANDLE_BYTES
        if len(handles) % cuda_ipc.HANDLE_BYTES or len(devices) != n:
            raise InvalidArgumentError(
                f"gather.source_handles: {len(handles)} bytes for {len(devices)} source_devices; each source "
                f"has a {cuda_ipc.HANDLE_BYTES}-byte handle", field="gather.source_handles",
            )  # fmt: skip
        if sizes.size and int(source.max()) >= n:
            raise InvalidArgumentError(f"gather.spans: source {int(source.max())} of {n}",
                                       field="gather.spans")  # fmt: skip
        if sizes.size and int(region.max()) >= self.regions.size:
            raise InvalidArgumentError(
                f"gather.spans: region {int(region.max())}, but this worker registered {self.regions.size} regions",
                field="gather.spans",
            )  # fmt: skip
        sources = self._pin(handles, devices)
        return self.regions[region] + dst_off, sources.bases[source] + src_off, sizes, sources

    def _pin(self, handles: bytes, devices: Sequence[str]) -> _SourceSet:
        """One publisher's allocations as mapped here (mapped at first use), pinned for one gather."""
        with self._lock:
            got = self._sources.get(handles)
            if got is None:
                got = self._sources[handles] = self._map_all(handles, devices)
                while len(self._sources) > MAX_SOURCE_SETS:  # least recently used: no longer kept mapped
                    _, old = self._sources.popitem(last=False)
                    old.kept = False
                    self._unmap_idle(old)
            else:
                self._sources.move_to_end(handles)
            got.gathers += 1
            return got

    def _unpin(self, sources: _SourceSet) -> None:
        with self._lock:
            sources.gathers -= 1
            self._unmap_idle(sources)

    def _unmap_idle(self, sources: _SourceSet) -> None:
        if not sources.kept and not sources.gathers:
            for key in sources.keys:
                self._unmap(key)

    def _map_all(self, handles: bytes, devices: Sequence[str]) -> _SourceSet:
        step = cuda_ipc.HANDLE_BYTES
        keys: list[_Key] = []
        bases: list[int] = []
        try:
            for i, device in enumerate(devices):
                handle = handles[i * step : (i + 1) * step]
                ordinal, base = self._map(handle, device)
                keys.append((ordinal, handle))
                bases.append(base)
        except cuda_ipc.CudaIpcError:
            for key in keys:
                self._unmap(key)
            raise
        return _SourceSet(np.array(bases, dtype=np.uint64), tuple(keys))

    def _map(self, handle: bytes, device_uuid: str) -> tuple[int, int]:
        try:
            return self.device, cuda_ipc.mappings.acquire(self.device, handle)[0]
        except cuda_ipc.CudaIpcError as first:  # no peer access: map it on its own GPU, if this process sees it
            drv = cuda_ipc.driver()
            for other in range(drv.device_count()):
                if other != self.device and drv.device_uuid(other).lower() == device_uuid.lower():
                    return other, cuda_ipc.mappings.acquire(other, handle)[0]
            raise first from None

    def _unmap(self, key: _Key) -> None:
        cuda_ipc.mappings.release(*key)

    def close(self) -> None:
        """Unmap every allocation kept (one a gather still copies from goes once that gather ended)."""
        with self._lock:
            kept, self._sources = self._sources, OrderedDict()
            for sources in kept.values():
                sources.kept = False
                self._unmap_idle(sources)


def _spans(raw: bytes) -> npt.NDArray[np.uint64]:
    """A plan's 40-byte spans as five rows: source, offset in it, region, offset in it, bytes."""
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 5).astype(np.uint64).T


_CANNED_SPANS = np.array([[0, 0, 0, 0, 16]], dtype="<u8").tobytes()  # what warm_up reads


def settled(resp: local_pb2.PullResponse, outcome: GatherOutcome, t0: float) -> PullResult:
    """The pull's result from the worker's own gather, once it started (``outcome.launched``).

    Raises :class:`KvxferRpcError` for a failed gather: DEADLINE_EXCEEDED (field ``timeout_seconds``)
    when the copies ended past the deadline, else UNAVAILABLE (reason DATA_PLANE). ``t0``:
    ``time.perf_counter()`` when the Pull call began.
    """
    if not outcome.ok:
        code = grpc.StatusCode.DEADLINE_EXCEEDED if outcome.late else grpc.StatusCode.UNAVAILABLE
        raise KvxferRpcError(code, f"the worker's gather of {resp.request_id!r} failed: {outcome.error}", "Pull",
                             reason=Reason.DEADLINE if outcome.late else Reason.DATA_PLANE,
                             field="timeout_seconds" if outcome.late else None)  # fmt: skip
    return PullResult(resp.transfer_id, resp.request_id, True, outcome.bytes, outcome.spans,
                      time.perf_counter() - t0, outcome.seconds)  # fmt: skip


def report_lost(fut: Future[Any] | Any) -> None:
    """Log a background GatherDone that failed (a done callback of its task or future)."""
    if fut.cancelled() or fut.exception() is None:
        return
    # The bytes were in place while the publishers' promise held: only the sidecar's bookkeeping
    # of the pull (its notices to the publishers, metrics) is late; its deadline ends it.
    log.warning("the sidecar did not take a gather's report", extra={"error": str(fut.exception())})
