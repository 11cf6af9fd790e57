"""Same-host GPU READs and WRITEs by CUDA device copies: a transport wrapper around any backend.

A sidecar's GPU memory is the worker's, opened by CUDA IPC, and CUDA cannot export IPC-opened
memory again (``cuIpcGetMemHandle`` fails on it), so UCX's cuda_ipc transport cannot serve it and a
NIXL READ between two sidecars of one node falls back to copies through host memory over tcp
(0.4 GB/s on the lent H100 against a 1400 GB/s device copy). Instead, a publisher advertises the
worker's own IPC handles in its data-plane metadata; a peer on the same host opens them itself
and READs (pull) or WRITEs (push) with device copies on its GPU. A WRITE returns, even when it is
cancelled or runs past its budget, only once its queued copies have finished: queued device copies
cannot be recalled, and a push's fence (kvxfer.server.push_steps) relies on nothing landing after
it. Anything else (another host, DRAM, a handle that will not open) goes through the wrapped
backend. ``kvxfer serve --cuda-ipc-direct false`` (or ``KVXFER_CUDA_IPC_DIRECT=0``) turns it off;
:func:`kvxfer.transport.create_transport` wraps a backend when ``TransportConfig.cuda_ipc_direct``
is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer import cuda_ipc
from kvxfer.errors import KvxferError
from kvxfer.logs import get_logger
from kvxfer.topology import RegionIndex, RegionTable
from kvxfer.transport.base import MemType, Notification, Op, Registration, SameHostGather, TransferResult, Transport
from kvxfer.transport.errors import TransferFailedError, TransferTimeoutError

__all__ = ["CudaIpcDirect"]

log = get_logger("kvxfer.transport.cuda_ipc_direct")

U64 = npt.NDArray[np.uint64]

#: The event loop polls a READ's event this long before a thread sleeps in the driver for it: most
#: same-host READs finish within it, and a sleeping wait added about 0.1 ms per pull on the lent H200.
SPIN_S = 0.002


_ENVELOPE = b"KVXFER-CUDA-IPC/1\n"  # metadata = envelope, 4-byte header length, JSON header, backend metadata


def _host_id() -> str:
    """Same value for every process of one running kernel (containers of one node included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class _Export:
    """A registered region as peers on this host can reach it: the worker's allocation handle."""

    base: int  # the region's address in the publishing sidecar
    size: int
    handle: bytes
    offset: int  # the region's offset in the worker's allocation
    uuid: str


@dataclass
class _Peer:
    """A publisher on this host whose worker memory this process maps itself."""

    bases: npt.NDArray[np.uint64]  # by export
    index: RegionIndex  # the exports, searchable by address
    exports: list[_Export]
    opened: dict[int, tuple[int, int]] = field(default_factory=dict)  # export index -> (device, local base)
    broken: str = ""
    # Per export, once mapped: what to add (mod 2**64) to the peer's address to get the address here.
    shift: U64 = field(init=False)
    mapped: npt.NDArray[np.bool_] = field(init=False)
    offsets: U64 = field(init=False)  # per export, its offset in the worker's allocation
    handles: bytes = field(init=False)  # every export's handle, one after the other (same_host_gather)
    uuids: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = np.array([e.offset for e in self.exports], dtype=np.uint64)
        self.handles = b"".join(e.handle for e in self.exports)
        self.uuids = tuple(e.uuid for e in self.exports)
        self.shift = np.zeros(len(self.exports), dtype=np.uint64)
        self.mapped = np.zeros(len(self.exports), dtype=bool)


class CudaIpcDirect(Transport):
    """A :class:`Transport` that READs VRAM of publishers on the same host with device copies.

    See the module docstring. Wraps any transport; its metadata is the wrapped one's unless GPU
    memory registered by CUDA IPC is present.
    """

    def __init__(self, inner: Transport, *, enabled: bool = True) -> None:
        self._inner = inner  # first: the base class sets the unfenced hook, which goes to the wrapped backend
        super().__init__(inner.agent_name, inner.config)
        self.enabled = enabled
        self._host = _host_id()
        self._pid = os.getpid()
        self._exports: dict[int, tuple[_Export, ...]] = {}
        self._peers: dict[str, _Peer] = {}
        self.direct_reads = 0  # READs that took the shortcut (tests, benchmarks)
        self.direct_writes = 0  # WRITEs (push mode) that took it
        self.kernel_reads = 0  # of those, READs moved by one gather launch (kvxfer.cuda_gather)
        self._kernel = inner.config.cuda_gather == "kernel"
        self._warned_kernel = False
        self._waiter: ThreadPoolExecutor | None = None  # waits for device copies (one stream: in order)

    name = "cuda-ipc-direct"

    @property
    def backend(self) -> str:
        """The wrapped backend's name: what peers compare in a handshake."""
        return self._inner.backend

    @property
    def inner(self) -> Transport:
        """The wrapped backend."""
        return self._inner

    # The wrapped backend's transfers are the ones that can end unfenced: its count, hook and handles.
    @property
    def on_unfenced(self) -> Callable[[str, str], None] | None:
        return self._inner.on_unfenced

    @on_unfenced.setter
    def on_unfenced(self, hook: Callable[[str, str], None] | None) -> None:
        self._inner.on_unfenced = hook

    @property
    def unfenced_total(self) -> int:
        return self._inner.unfenced_total

    @unfenced_total.setter
    def unfenced_total(self, value: int) -> None:
        pass  # counted by the wrapped backend

    def unfenced_live(self) -> int:
        return self._inner.unfenced_live()

    # ------------------------------------------------------------------ registration
    def register(self, table: RegionTable, mem_type: MemType = "DRAM") -> Registration:
        reg = self._inner.register(table, mem_type)
        exports = self._exports_of(table, mem_type)
        if exports:
            self._exports[id(reg)] = exports
        return reg

    def _exports_of(self, table: RegionTable, mem_type: str) -> tuple[_Export, ...]:
        if not (self.enabled and mem_type == "VRAM" and self._host):
            return ()
        out = []
        for base, size in zip(table.base.tolist(), table.size.tolist(), strict=True):
            found = cuda_ipc.mappings.locate(int(base))
            if found is None:
                return ()  # library mode: nothing another process could open
            ordinal, handle, offset = found
            out.append(_Export(int(base), int(size), handle, offset, cuda_ipc.driver().device_uuid(ordinal)))
        return tuple(out)

    def deregister(self, registration: Registration) -> None:
        self._exports.pop(id(registration), None)
        self._inner.deregister(registration)

    def metadata(self) -> bytes:
        inner = self._inner.metadata()
        exports = [e for group in self._exports.values() for e in group]
        if not exports:
            return inner
        header = json.dumps({
            "host": self._host, "pid": self._pid,
            "regions": [[e.base, e.size, e.handle.hex(), e.offset, e.uuid] for e in exports],
        }).encode()  # fmt: skip
        return _ENVELOPE + len(header).to_bytes(4, "big") + header + inner

    # ------------------------------------------------------------------ peers
    def add_peer(self, metadata: bytes) -> str:
        header: dict[str, Any] | None = None
        if metadata.startswith(_ENVELOPE):
            n = int.from_bytes(metadata[len(_ENVELOPE) : len(_ENVELOPE) + 4], "big")
            start = len(_ENVELOPE) + 4
            header = json.loads(metadata[start : start + n])
            metadata = metadata[start + n :]
        name = self._inner.add_peer(metadata)
        self._drop_peer(name)  # a reloaded peer may have new memory
        if header is not None and self.enabled and header.get("host") == self._host and header.get("pid") != self._pid:
            exports = [_Export(int(b), int(s), bytes.fromhex(h), int(o), str(u)) for b, s, h, o, u in header["regions"]]
            bases = np.array([e.base for e in exports], dtype=np.uint64)
            index = RegionIndex.of(bases, np.array([e.size for e in exports], dtype=np.uint64))
            self._peers[name] = _Peer(bases, index, exports)
            log.info("same-host peer: READs of its GPU memory use CUDA IPC device copies", extra={"peer": name})
        return name

    def remove_peer(self, name: str) -> None:
        self._drop_peer(name)
        self._inner.remove_peer(name)

    def _drop_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        for i, (ordinal, _base) in peer.opened.items():
            try:
                cuda_ipc.mappings.release(ordinal, peer.exports[i].handle)
            except KvxferError as exc:
                log.warning("could not unmap a peer's CUDA IPC handle", extra={"peer": name, "error": exc.message})

    # ------------------------------------------------------------------ transfers
    async def transfer(
        self, op: Op, local: U64, remote: U64, peer: str, *, timeout: float, notify: bytes | None = None,
        mem_type: MemType = "DRAM", remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:  # fmt: skip
        p = self._peers.get(peer)
        direct = notify is None and mem_type == "VRAM" and remote_mem_type == "VRAM"
        if direct and p is not None and not p.broken and local.shape[0]:
            t_enter = time.perf_counter()
            ordinal = int(local[0, 2])
            try:
                theirs = self._translate(peer, p, remote, ordinal)
            except cuda_ipc.CudaIpcError as exc:
                p.broken = exc.message
                log.warning(
                    f"same-host CUDA IPC {op} unavailable for this peer; using the backend",
                    extra={"peer": peer, "error": exc.message},
                )  # fmt: skip
            else:
                t0 = time.perf_counter()
                write = op == "WRITE"
                dst, src = (theirs, local[:, 0]) if write else (local[:, 0], theirs)
                await self._copy(peer, ordinal, dst, src, local[:, 1], timeout, drain=write, t_enter=t_enter)
                if write:
                    self.direct_writes += 1
                else:
                    self.direct_reads += 1
                return TransferResult(int(local[:, 1].sum()), int(local.shape[0]), time.perf_counter() - t0)
        return await self._inner.transfer(
            op, local, remote, peer, timeout=timeout, notify=notify, mem_type=mem_type, remote_mem_type=remote_mem_type
        )

    def same_host_gather(
        self, peer: str, local: U64, remote: U64, *, mem_type: MemType, remote_mem_type: MemType
    ) -> SameHostGather | None:
        """The READ as the publishing worker's allocations and offsets in them, for the worker here to run."""
        p = self._peers.get(peer)
        if p is None or p.broken or mem_type != "VRAM" or remote_mem_type != "VRAM" or not local.shape[0]:
            return None
        idx = self._inside(peer, p, remote)
        # The offset in the worker's allocation: the descriptor's offset in the export, plus the export's.
        offset = remote[:, 0].astype(np.uint64, copy=False) - p.bases[idx] + p.offsets[idx]
        return SameHostGather(p.handles, p.uuids, idx.astype(np.uint64), offset)

    def poll_notifications(self) -> list[Notification]:
        return self._inner.poll_notifications()

    @staticmethod
    def _inside(name: str, p: _Peer, remote: U64) -> npt.NDArray[np.intp]:
        """Per descriptor, the index of the peer's export it lies in; raises if one lies in none."""
        idx, inside = p.index.find(remote[:, 0], remote[:, 1])
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise TransferFailedError(
                f"remote descriptor {bad} ({int(remote[bad, 0]):#x}, {int(remote[bad, 1])} bytes) is outside the "
                "peer's registered regions", backend="cuda-ipc", peer=name,
            )  # fmt: skip
        return idx

    def _translate(self, name: str, p: _Peer, remote: U64, ordinal: int) -> U64:
        """The peer's descriptor addresses as addresses of the worker's memory mapped in this process.

        A handful of vectorized steps, whatever the number of descriptors or regions: this is on
        every same-host READ's way (a loop over the regions cost 70-100 us a READ).
        """
        idx = self._inside(name, p, remote)
        addr = remote[:, 0].astype(np.uint64, copy=False)
        unmapped = ~p.mapped[idx]
        if unmapped.any():  # first READs only: map the allocations they touch
            for i in np.unique(idx[unmapped]).tolist():
                e = p.exports[i]
                p.opened[i] = self._open(e, ordinal)
                p.shift[i] = np.uint64((p.opened[i][1] + e.offset - e.base) % (1 << 64))
                p.mapped[i] = True
        return addr + p.shift[idx]  # uint64: wraps modulo 2**64, as the shift was taken

    @staticmethod
    def _open(e: _Export, ordinal: int) -> tuple[int, int]:
        """Map a peer worker's allocation: on our GPU (peer access), else on its own GPU if we see it."""
        try:
            return ordinal, cuda_ipc.mappings.acquire(ordinal, e.handle)[0]
        except cuda_ipc.CudaIpcError as first:
            drv = cuda_ipc.driver()
            for other in range(drv.device_count()):
                if other != ordinal and drv.device_uuid(other).lower() == e.uuid.lower():
                    return other, cuda_ipc.mappings.acquire(other, e.handle)[0]
            raise first from None

    async def _copy(
        self, peer: str, ordinal: int, dst: U64, src: U64, sizes: U64, budget: float, *, drain: bool, t_enter: float
    ) -> None:
        """Device copies ``src`` -> ``dst``; with ``drain`` it never returns while one may still land.

        ``t_enter``: when the transfer began (the debug line's ``translate_us`` is the time until here).
        """
        drv = cuda_ipc.driver()
        t_submit = time.perf_counter()
        try:
            batch = drv.copy_async(ordinal, dst, src, sizes, kernel=self._kernel)
        except cuda_ipc.CudaIpcError as exc:
            raise TransferFailedError(f"device copies did not start: {exc.message}", backend="cuda-ipc",
                                      peer=peer) from None  # fmt: skip
        if batch.how == "kernel":
            self.kernel_reads += 1
        elif self._kernel and not self._warned_kernel and drv.kernels.error:
            self._warned_kernel = True
            log.warning("same-host GPU READs use the copy engines: the gather kernel is unavailable",
                        extra={"error": drv.kernels.error})  # fmt: skip
        t_queued = time.perf_counter()
        finished, landed, polls = self._watch(drv, batch)
        try:
            async with asyncio.timeout(budget):
                t_done = await finished
        except TimeoutError:
            if drain:  # queued copies cannot be recalled: a WRITE is over only once they have landed
                await _drained(landed)
            raise TransferTimeoutError(
                f"{sizes.size} device copies did not finish within {budget:.3f}s", backend="cuda-ipc", peer=peer
            ) from None
        except asyncio.CancelledError:
            if drain:
                await _drained(landed)
            raise
        except cuda_ipc.CudaIpcError as exc:
            raise TransferFailedError(f"device copies failed: {exc.message}", backend="cuda-ipc", peer=peer) from None
        if log.isEnabledFor(logging.DEBUG):  # where a transfer's fixed cost goes (bench/gpu/sidecar_vram_bench.py)
            log.debug("same-host READ phases" if not drain else "same-host WRITE phases", extra={
                "peer": peer, "spans": int(sizes.size), "bytes": int(sizes.sum()), "how": batch.how,
                "translate_us": (t_submit - t_enter) * 1e6, "polls": polls[0],
                "submit_us": (t_queued - t_submit) * 1e6,
                "gpu_us": (t_done - t_queued) * 1e6, "wake_us": (time.perf_counter() - t_done) * 1e6,
                "kernel_table_upload_launch_us": list(drv.kernels.last_us) if batch.how == "kernel" else None,
            })  # fmt: skip

    def _watch(
        self, drv: cuda_ipc.CudaDriver, batch: cuda_ipc.CopyBatch
    ) -> tuple[asyncio.Future[float], asyncio.Future[float], list[int]]:
        """Two futures of when ``batch`` finished: one for the READ to await (cancelling it stops
        nothing), and one that always ends with the copies (a WRITE that is cancelled waits for it);
        and a counter of the event loop's polls (debug logs).

        The event loop polls the batch's event once per turn for up to :data:`SPIN_S` (other
        callbacks and I/O run between polls), so a same-host READ, which mostly takes well under
        that, is seen done within one turn and its task resumes on the next: a waiter thread cost
        about 0.15 ms per READ on the lent H200 in handing the wait over and waking the loop again.
        Past it, a thread sleeps in the driver until the copies end.
        """
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[float] = loop.create_future()
        landed: asyncio.Future[float] = loop.create_future()
        for fut in (finished, landed):
            fut.add_done_callback(_retrieved)
        until = time.perf_counter() + SPIN_S
        polls = [0]

        def end(t_done: float | None, exc: BaseException | None = None) -> None:
            for fut in (finished, landed):
                if fut.done():
                    continue  # the READ was cancelled or ran out of time
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(t_done or 0.0)

        def poll() -> None:
            polls[0] += 1
            try:
                if drv.done(batch):
                    end(time.perf_counter())
                    return
            except cuda_ipc.CudaIpcError as exc:
                end(None, exc)
                return
            if time.perf_counter() < until:
                loop.call_soon(poll)
                return
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-cuda-wait")

            def wait() -> float:
                drv.wait(batch)
                return time.perf_counter()

            def waited(f: asyncio.Future[float]) -> None:
                exc = f.exception()
                end(None if exc else f.result(), exc)

            loop.run_in_executor(self._waiter, wait).add_done_callback(waited)

        loop.call_soon(poll)
        return finished, landed, polls

    def close(self) -> None:
        for name in list(self._peers):
            self._drop_peer(name)
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)
        self._inner.close()


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark an outcome nobody may await any more (a cancelled READ's copies) as seen."""
    if not fut.cancelled():
        fut.exception()


async def _drained(waiter: asyncio.Future[Any]) -> None:
    """Until the device copies behind ``waiter`` finished (cancelling the caller again does not stop the wait)."""
    while not waiter.done():
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            continue
        except Exception:
            return
