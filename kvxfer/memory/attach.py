"""The sidecar's side: map the memory a worker's reference names, checked against the layout."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvxfer import cuda_ipc
from kvxfer.errors import KvxferError
from kvxfer.layout import KVCacheLayout
from kvxfer.memory.refs import (
    CudaIpcRef,
    FdLookup,
    FdMemoryRef,
    LibraryRef,
    MemoryRef,
    MemoryRegistrationError,
    SharedMemoryRef,
    shm_path,
)
from kvxfer.memory.segments import Segment
from kvxfer.topology import RegionTable

__all__ = ["AttachedMemory", "attach"]


# ---------------------------------------------------------------------------- sidecar side
class AttachedMemory:
    """Sidecar side: a cache group's regions mapped into this process, as a :class:`RegionTable`."""

    def __init__(
        self, table: RegionTable, mem_type: str, segments: Sequence[Segment] = (),
        release: Sequence[Callable[[], None]] = (),
    ) -> None:  # fmt: skip
        self.table = table
        self.mem_type = mem_type
        self._segments = list(segments)
        self._release = list(release)

    @property
    def nbytes(self) -> int:
        """Bytes of all regions."""
        return int(self.table.size.sum())

    def close(self) -> None:
        """Unmap the segments and CUDA IPC mappings (never frees them: the worker owns them).

        Call after the data plane deregistered the memory.
        """
        for s in self._segments:
            s.close()
        self._segments.clear()
        release, self._release = self._release, []
        for fn in release:
            with contextlib.suppress(KvxferError):  # a failed unmap must not keep the others mapped
                fn()


def attach(
    ref: MemoryRef, layout: KVCacheLayout, *, field: str = "memory", fds: FdLookup | None = None,
    agent_pid: int | None = None,
) -> AttachedMemory:  # fmt: skip
    """Map the memory a worker described for ``layout``; raises naming ``field`` on any mismatch.

    ``fds`` resolves the handle of an :class:`FdMemoryRef` (the sidecar's :class:`kvxfer.fdpass.FdBox`).
    ``agent_pid`` is the process whose data-plane agent moves the memory when it is not this one
    (``--backend worker``): then only :class:`LibraryRef` addresses of that process are taken, as they are.
    """
    if agent_pid is not None and not isinstance(ref, LibraryRef):
        raise MemoryRegistrationError(
            f"{field}: the worker's own agent moves this memory (--backend worker), so the sidecar maps nothing: "
            f"describe it as library memory (the worker's addresses, pid {agent_pid}), not {type(ref).__name__}",
            field=field,
        )
    if isinstance(ref, CudaIpcRef):
        return _attach_cuda_ipc(ref, layout, field)
    if isinstance(ref, LibraryRef):
        return _attach_library(ref, layout, field, agent_pid if agent_pid is not None else os.getpid())
    if isinstance(ref, FdMemoryRef):
        return _attach_fds(ref, layout, field, fds)
    return _attach_shm(ref, layout, field)


def _count(n: int, layout: KVCacheLayout, where: str) -> None:
    if n != layout.num_regions:
        raise MemoryRegistrationError(
            f"{where}: the layout has {layout.num_regions} regions "
            f"({'one cross-layer region' if layout.cross_layer else 'one per layer'}), got {n}",
            field=where,
        )


def _attach_library(ref: LibraryRef, layout: KVCacheLayout, field: str, agent_pid: int) -> AttachedMemory:
    where = f"{field}.library"
    if ref.pid != agent_pid:
        mover = "this sidecar is" if agent_pid == os.getpid() else "the worker's agent runs in"
        raise MemoryRegistrationError(
            f"{where}.pid: library-mode addresses belong to process {ref.pid}, but {mover} process {agent_pid}; a "
            "worker in another process must use shared memory, or run the data plane itself (--backend worker)",
            field=f"{where}.pid",
        )
    _count(len(ref.addresses), layout, f"{where}.addresses")
    if any(a == 0 for a in ref.addresses):
        raise MemoryRegistrationError(f"{where}.addresses: null address", field=f"{where}.addresses")
    mem = (ref.memory_type or "DRAM").upper()
    if mem not in ("DRAM", "VRAM"):
        raise MemoryRegistrationError(
            f"{where}.memory_type: {ref.memory_type!r} is not DRAM or VRAM", field=f"{where}.memory_type"
        )
    table = RegionTable.for_layout(layout, list(ref.addresses), device=ref.device)
    return AttachedMemory(table, mem)


def _attach_shm(ref: SharedMemoryRef, layout: KVCacheLayout, field: str) -> AttachedMemory:
    where = f"{field}.shm.regions"
    _count(len(ref.regions), layout, where)
    segments: dict[str, Segment] = {}
    bases: list[int] = []
    try:
        for i, r in enumerate(ref.regions):
            path = shm_path(r.name)
            seg = segments.get(str(path))
            if seg is None:
                try:
                    seg = Segment(path, None, create=False)
                except FileNotFoundError:
                    raise MemoryRegistrationError(
                        f"{where}[{i}].name: shared-memory segment {r.name!r} ({path}) does not exist (is /dev/shm "
                        "shared between the worker and the sidecar?)",
                        field=f"{where}[{i}].name",
                    ) from None
                except PermissionError as exc:
                    raise MemoryRegistrationError(
                        f"{where}[{i}].name: cannot open {r.name!r}: {exc}", field=f"{where}[{i}].name"
                    ) from None
                segments[str(path)] = seg
            if r.offset % 8:
                raise MemoryRegistrationError(
                    f"{where}[{i}].offset: {r.offset} is not 8-byte aligned", field=f"{where}[{i}].offset"
                )
            if r.offset + layout.region_bytes > seg.size:
                raise MemoryRegistrationError(
                    f"{where}[{i}]: region of {layout.region_bytes} bytes at offset {r.offset} overruns segment "
                    f"{r.name!r} of {seg.size} bytes",
                    field=f"{where}[{i}].offset",
                )
            bases.append(seg.address + r.offset)
    except BaseException:
        for s in segments.values():
            s.close()
        raise
    return AttachedMemory(RegionTable.for_layout(layout, bases), "DRAM", list(segments.values()))


def _attach_fds(ref: FdMemoryRef, layout: KVCacheLayout, field: str, lookup: FdLookup | None) -> AttachedMemory:
    where = f"{field}.fd"
    _count(len(ref.regions), layout, f"{where}.regions")
    try:
        if lookup is None:
            raise KeyError(ref.handle)
        fds, sizes, pid = lookup(ref.handle)
    except KeyError:
        raise MemoryRegistrationError(
            f"{where}.handle: {ref.handle!r} names no descriptors this sidecar holds (the worker passes them on the "
            "descriptor socket beside the local socket and keeps that connection open)",
            field=f"{where}.handle",
        ) from None
    segments: dict[int, Segment] = {}
    bases: list[int] = []
    try:
        for i, r in enumerate(ref.regions):
            if not 0 <= r.index < len(fds):
                raise MemoryRegistrationError(
                    f"{where}.regions[{i}].index: {r.index} is not one of the {len(fds)} descriptors passed",
                    field=f"{where}.regions[{i}].index",
                )
            if r.offset % 8 or r.offset + layout.region_bytes > sizes[r.index]:
                raise MemoryRegistrationError(
                    f"{where}.regions[{i}].offset: a region of {layout.region_bytes} bytes at offset {r.offset} does "
                    f"not fit descriptor {r.index} of {sizes[r.index]} bytes (or is not 8-byte aligned)",
                    field=f"{where}.regions[{i}].offset",
                )
            seg = segments.get(r.index)
            if seg is None:
                seg = segments[r.index] = Segment(Path(f"/proc/{pid}/fd/{fds[r.index]}"), None, create=False,
                                                   fd=fds[r.index])  # fmt: skip
            bases.append(seg.address + r.offset)
    except BaseException:
        for s in segments.values():
            s.close()
        raise
    return AttachedMemory(RegionTable.for_layout(layout, bases), "DRAM", list(segments.values()))


def _attach_cuda_ipc(ref: CudaIpcRef, layout: KVCacheLayout, field: str) -> AttachedMemory:
    where = f"{field}.cuda_ipc"
    n = len(ref.handles)
    _count(n, layout, f"{where}.handles")
    for name, values in (("offsets", ref.offsets), ("sizes", ref.sizes)):
        if len(values) != n and (name == "offsets" or values):
            raise MemoryRegistrationError(
                f"{where}.{name}: {len(values)} given for {n} handles", field=f"{where}.{name}"
            )
    for i, h in enumerate(ref.handles):
        if len(h) != cuda_ipc.HANDLE_BYTES:
            raise MemoryRegistrationError(
                f"{where}.handles[{i}]: {len(h)} bytes; a CUDA IPC handle has {cuda_ipc.HANDLE_BYTES}",
                field=f"{where}.handles[{i}]",
            )
    for i, size in enumerate(ref.sizes):
        if size and size < layout.region_bytes:
            raise MemoryRegistrationError(
                f"{where}.sizes[{i}]: the tensor has {size} bytes, the layout's region needs {layout.region_bytes} "
                f"({'all layers' if layout.cross_layer else 'one layer'} of {layout.num_blocks} blocks)",
                field=f"{where}.sizes[{i}]",
            )
    if ref.device < 0:
        raise MemoryRegistrationError(f"{where}.device: {ref.device} is negative", field=f"{where}.device")
    maps = cuda_ipc.mappings
    try:
        drv = maps.driver()
    except cuda_ipc.CudaUnavailableError as exc:
        raise cuda_ipc.CudaUnavailableError(
            f"{where}: this sidecar cannot open CUDA IPC handles: {exc.message}. Run it on the worker's GPU "
            "node with the NVIDIA driver mounted, or register shared memory instead",
            field=where,
        ) from None
    ordinal = _sidecar_device(drv, ref, where)
    opened: list[bytes] = []
    bases: list[int] = []
    try:
        for i, (h, off) in enumerate(zip(ref.handles, ref.offsets, strict=True)):
            try:
                base, alloc = maps.acquire(ordinal, h)
            except cuda_ipc.CudaIpcError as exc:
                raise cuda_ipc.CudaIpcError(
                    f"{where}.handles[{i}]: cannot open the worker's CUDA IPC handle on device {ordinal}: "
                    f"{exc.message}. The worker must be alive, in another process than the sidecar (same "
                    "process: use library mode), and on a GPU this sidecar can reach",
                    code=exc.code, field=f"{where}.handles[{i}]",
                ) from None  # fmt: skip
            opened.append(h)
            if alloc and off + layout.region_bytes > alloc:
                raise MemoryRegistrationError(
                    f"{where}.offsets[{i}]: a region of {layout.region_bytes} bytes at offset {off} overruns the "
                    f"worker's allocation of {alloc} bytes",
                    field=f"{where}.offsets[{i}]",
                )
            bases.append(base + off)
    except BaseException:
        for h in opened:
            with contextlib.suppress(KvxferError):
                maps.release(ordinal, h)
        raise
    release = [functools.partial(maps.release, ordinal, h) for h in opened]
    return AttachedMemory(RegionTable.for_layout(layout, bases, device=ordinal), "VRAM", release=release)


def _sidecar_device(drv: cuda_ipc.CudaDriver, ref: CudaIpcRef, where: str) -> int:
    """This process's ordinal of the worker's GPU: by UUID when given, else the worker's ordinal."""
    count = drv.device_count()
    if ref.device_uuid:
        seen = [drv.device_uuid(o) for o in range(count)]
        for o, u in enumerate(seen):
            if u.lower() == ref.device_uuid.lower():
                return o
        raise cuda_ipc.CudaUnavailableError(
            f"{where}.device_uuid: the worker's GPU {ref.device_uuid} is not visible to this sidecar (it sees "
            f"{', '.join(seen) or 'none'}); give the sidecar the worker's GPU (CUDA_VISIBLE_DEVICES, the pod's "
            "GPU resources)",
            field=f"{where}.device_uuid",
        )
    if ref.device >= count:
        raise cuda_ipc.CudaUnavailableError(
            f"{where}.device: device {ref.device} is not visible to this sidecar ({count} visible)",
            field=f"{where}.device",
        )
    return ref.device
