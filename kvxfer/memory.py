"""KV memory the sidecar can reach: shared memory (CPU), CUDA IPC (GPU), or in-process.

A worker hands its KV cache to the sidecar in one of three ways:

* **Shared memory** (CPU workers): the worker keeps its cache in a POSIX shared-memory segment laid
  out in the standardized layout (one region per layer, or one for a cross-layer cache) and tells
  the sidecar the segment name and each region's offset. :class:`SharedKVBuffer` creates such a
  segment; the sidecar maps the same pages with :func:`attach` and registers them with the data
  plane, so transfers land directly in the worker's memory (no copy through the sidecar).
* **CUDA IPC** (GPU workers): :meth:`CudaIpcRef.from_tensors` exports the worker's KV tensors (no
  copy: a handle of each tensor's ``cudaMalloc`` allocation and the tensor's offset in it);
  :func:`attach` opens the handles in the sidecar (:mod:`kvxfer.cuda_ipc`) and the data plane
  registers them as VRAM. The worker keeps the tensors alive while they are registered.
* **Library mode**: the sidecar runs inside the worker process and uses the tensors' addresses as
  they are (:meth:`LibraryRef.from_arrays`).

Segments are files under ``/dev/shm`` (that is what ``shm_open`` names on Linux); a name may also
be an absolute path to a file on any shared tmpfs (a Kubernetes ``emptyDir: {medium: Memory}``
mounted in both containers). Python's ``multiprocessing.shared_memory`` is not used because its
resource tracker unlinks a segment when any process that attached it exits (Python < 3.13).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer import cuda_ipc
from kvxfer.errors import KvxferError, LayoutError, Reason
from kvxfer.layout import KVCacheLayout, Plane
from kvxfer.topology import RegionTable

__all__ = [
    "ALIGNMENT",
    "AttachedMemory",
    "CudaIpcRef",
    "FdLookup",
    "FdMemoryRef",
    "FdRegionRef",
    "LibraryRef",
    "MemoryRef",
    "MemoryRegistrationError",
    "SharedKVBuffer",
    "SharedMemoryRef",
    "ShmRegionRef",
    "UnsupportedMemoryError",
    "attach",
    "shm_path",
]

ALIGNMENT = 4096  # regions start on page boundaries so RDMA registration covers whole pages
SHM_DIR = Path("/dev/shm")
U8 = npt.NDArray[np.uint8]


class MemoryRegistrationError(KvxferError):
    """Memory the worker described cannot be used (missing segment, too small, wrong process)."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.MEMORY


class UnsupportedMemoryError(KvxferError):
    """A memory kind that this build cannot register."""

    status = "UNIMPLEMENTED"
    default_reason = Reason.UNSUPPORTED


def shm_path(name: str) -> Path:
    """Filesystem path of a segment: ``/dev/shm/<name>``, or ``name`` itself when it is absolute."""
    if name.startswith("/") and name.count("/") > 1:
        return Path(name)
    bare = name.lstrip("/")
    if not bare or "/" in bare or bare in (".", ".."):
        raise MemoryRegistrationError(f"shm name: {name!r} is not a valid segment name", field="shm.name")
    return SHM_DIR / bare


# ---------------------------------------------------------------------------- references
@dataclass(frozen=True)
class ShmRegionRef:
    """Where one region lives: a segment and an offset in it."""

    name: str
    offset: int


@dataclass(frozen=True)
class SharedMemoryRef:
    """Shared-memory regions of one cache group, one per region of its layout, in region order."""

    regions: tuple[ShmRegionRef, ...]


@dataclass(frozen=True)
class CudaIpcRef:
    """CUDA IPC exports of one cache group's regions (one per region of its layout, in region order).

    ``handles[i]`` names the ``cudaMalloc`` allocation holding region i and ``offsets[i]`` where the
    region starts in it (tensors rarely start at their allocation's base). ``sizes[i]`` is the
    tensor's byte size (0: unknown), checked against the layout. ``device`` is the worker's ordinal
    and ``device_uuid`` the GPU's UUID, which the sidecar prefers: ordinals differ between processes
    with different ``CUDA_VISIBLE_DEVICES``.
    """

    handles: tuple[bytes, ...]
    offsets: tuple[int, ...]
    device: int = 0
    sizes: tuple[int, ...] = ()
    device_uuid: str = ""

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any]) -> CudaIpcRef:
        """Export CUDA ``tensors`` (one per region: per-layer KV tensors, or one cross-layer tensor).

        Each tensor must be dense (contiguous, or a permutation of contiguous such as a block-major
        cross-layer cache) and live on one device, allocated with ``cudaMalloc`` (PyTorch's default
        caching allocator; not ``expandable_segments``). Nothing is copied; keep the tensors alive
        while the sidecar holds the registration. Raises :class:`MemoryRegistrationError` for a bad
        tensor and :class:`kvxfer.cuda_ipc.CudaUnavailableError` without a CUDA driver.
        """
        where = "memory.cuda_ipc"
        if len(tensors) == 0:
            raise MemoryRegistrationError(f"{where}: no tensors given (one per region)", field=where)
        devices: set[int] = set()
        sizes: list[int] = []
        for i, t in enumerate(tensors):
            if not getattr(t, "is_cuda", False):
                raise MemoryRegistrationError(
                    f"{where}: tensor {i} is on {getattr(t, 'device', type(t).__name__)}, not a CUDA device "
                    "(CPU workers share memory with SharedKVBuffer)",
                    field=where,
                )
            devices.add(int(t.device.index or 0))
            sizes.append(_dense_nbytes(t, f"{where}: tensor {i}"))
        if len(devices) > 1:
            raise MemoryRegistrationError(
                f"{where}: tensors are on devices {sorted(devices)}; one registration covers one GPU", field=where
            )
        return cls.from_addresses(devices.pop(), [int(t.data_ptr()) for t in tensors], sizes)

    @classmethod
    def from_addresses(cls, device: int, addresses: Sequence[int], sizes: Sequence[int]) -> CudaIpcRef:
        """Export regions given by address and size on ``device`` (e.g. vLLM's per-layer views of one buffer)."""
        where = "memory.cuda_ipc"
        drv = cuda_ipc.driver()
        exports = []
        for i, ptr in enumerate(addresses):
            try:
                exports.append(drv.export(device, int(ptr)))
            except cuda_ipc.CudaIpcError as exc:
                raise MemoryRegistrationError(f"{where}: region {i}: {exc.message}", field=where) from None
        return cls(
            tuple(e.handle for e in exports), tuple(e.offset for e in exports), device, tuple(int(n) for n in sizes),
            drv.device_uuid(device),
        )  # fmt: skip


def _dense_nbytes(t: Any, what: str) -> int:
    """Bytes of a tensor whose elements fill one gap-free span starting at ``data_ptr()``."""
    n = int(t.numel())
    if n == 0:
        raise MemoryRegistrationError(f"{what} is empty", field="memory.cuda_ipc")
    expected = 1
    # Any dim order is fine (a cross-layer cache is a permuted view); gaps and overlaps are not.
    for stride, size in sorted((int(st), int(sz)) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1):
        if stride != expected:
            raise MemoryRegistrationError(
                f"{what} is not dense (shape {tuple(t.shape)}, strides {tuple(t.stride())}): pass the whole "
                "cache tensor, not a slice of it",
                field="memory.cuda_ipc",
            )
        expected *= size
    return n * int(t.element_size())


@dataclass(frozen=True)
class LibraryRef:
    """Base addresses of one cache group's regions in this process (library mode)."""

    addresses: tuple[int, ...]
    device: int = 0
    memory_type: str = "DRAM"
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def from_arrays(cls, arrays: Sequence[Any]) -> LibraryRef:
        """Addresses of numpy arrays or torch tensors (one per region); they must stay alive."""
        addresses: list[int] = []
        device, mem = 0, "DRAM"
        for i, a in enumerate(arrays):
            if hasattr(a, "data_ptr"):  # torch
                if not a.is_contiguous():
                    raise MemoryRegistrationError(f"memory: tensor {i} is not contiguous", field="memory.library")
                addresses.append(int(a.data_ptr()))
                if a.is_cuda:
                    device, mem = int(a.device.index or 0), "VRAM"
            else:
                arr = np.asarray(a)
                if not arr.flags.c_contiguous:
                    raise MemoryRegistrationError(f"memory: array {i} is not contiguous", field="memory.library")
                addresses.append(int(arr.ctypes.data))
        return cls(tuple(addresses), device, mem)


@dataclass(frozen=True)
class FdRegionRef:
    """Where one region lives: the index of a passed descriptor and an offset in its file."""

    index: int
    offset: int


@dataclass(frozen=True)
class FdMemoryRef:
    """Regions in shared-memory files whose descriptors the worker passed (:mod:`kvxfer.fdpass`).

    ``handle`` is what the sidecar answered when it received the descriptors; one
    :class:`FdRegionRef` per region of the layout, in region order. Regions of several cache
    groups may lie in one file and even overlap (vLLM overlays its groups on one buffer).
    """

    handle: str
    regions: tuple[FdRegionRef, ...]


MemoryRef = SharedMemoryRef | CudaIpcRef | LibraryRef | FdMemoryRef
#: Looks up a descriptor handle: (descriptors, their sizes, sender pid); KeyError when unknown.
FdLookup = Callable[[str], tuple[tuple[int, ...], tuple[int, ...], int]]


# ---------------------------------------------------------------------------- segments
class _Segment:
    """One mapped segment file (opened by path, or a descriptor that is duplicated first)."""

    def __init__(self, path: Path, size: int | None, *, create: bool, fd: int | None = None) -> None:
        self.path = path
        if fd is not None:
            fd = os.dup(fd)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
        try:
            if create:
                assert size is not None
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise MemoryRegistrationError(f"shm segment {str(path)!r} is empty", field="shm.name")
            # MAP_POPULATE maps every page now: otherwise the first transfer into each page pays a
            # page fault inside the data plane (measured: early pulls ran at half speed).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: U8 | None = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)

    def close(self) -> None:
        self.array = None
        # BufferError: views handed out are still alive; the mapping goes when the last one does.
        with contextlib.suppress(BufferError):
            self.mm.close()


class SharedKVBuffer:
    """Worker side: one shared-memory segment holding every region of ``layout``, page-aligned.

    ``regions[i]`` is region i as a flat uint8 array; :meth:`pages` gives a (num_blocks, page_bytes)
    view of one layer. The creator unlinks the segment on :meth:`close` (and at interpreter exit).
    """

    def __init__(
        self, layout: KVCacheLayout, segment: _Segment, offsets: Sequence[int], *, owner: bool, name: str = ""
    ) -> None:
        self.layout = layout
        self.name = name
        self._segment = segment
        self.offsets = tuple(int(o) for o in offsets)
        self.owner = owner
        arr = segment.array
        assert arr is not None
        self.regions: list[U8] = [arr[o : o + layout.region_bytes] for o in self.offsets]

    @classmethod
    def create(cls, layout: KVCacheLayout, name: str | None = None, *, fill: int | None = 0) -> SharedKVBuffer:
        """A new segment sized for ``layout`` (name: random ``kvxfer-...`` under /dev/shm)."""
        name = name or f"kvxfer-{os.getpid()}-{secrets.token_hex(6)}"
        stride = _align(layout.region_bytes)
        offsets = [i * stride for i in range(layout.num_regions)]
        path = shm_path(name)
        try:
            seg = _Segment(path, stride * layout.num_regions, create=True)
        except FileExistsError:
            raise MemoryRegistrationError(f"shm name: segment {str(path)!r} already exists", field="shm.name") from None
        except OSError as exc:
            raise MemoryRegistrationError(f"shm name: cannot create {str(path)!r}: {exc}", field="shm.name") from None
        buf = cls(layout, seg, offsets, owner=True, name=name)
        atexit.register(buf._unlink_quietly)
        if fill:
            seg.array[:] = fill  # type: ignore[index]
        return buf

    @property
    def path(self) -> Path:
        """The segment's file."""
        return self._segment.path

    @property
    def addresses(self) -> list[int]:
        """Base address of each region in this process."""
        return [self._segment.address + o for o in self.offsets]

    def ref(self) -> SharedMemoryRef:
        """What the sidecar needs to attach these regions."""
        return SharedMemoryRef(tuple(ShmRegionRef(self.name, o) for o in self.offsets))

    def pages(self, layer: int) -> U8:
        """(num_blocks, page_bytes) view of one layer's pages (strided for a cross-layer cache).

        Only for layouts whose pages are contiguous (not heads_outer); :meth:`rows` works for all.
        """
        lay = self.layout
        if lay.heads_outer:
            raise LayoutError(f"pages: a {lay.stride_order} block is not one contiguous page; use rows()",
                              field="layout")  # fmt: skip
        region = self.regions[lay.region_of_layer(layer)]
        start = lay.layer_offset(layer)
        return np.lib.stride_tricks.as_strided(
            region[start:], shape=(lay.num_blocks, lay.page_bytes), strides=(lay.block_stride, 1), writeable=True
        )

    def rows(self, layer: int, plane: Plane) -> U8:
        """``plane``'s rows of ``layer``: a (blocks, kernel blocks, heads, tokens, elements, row bytes) view."""
        lay = self.layout
        offset, shape, strides = lay.plane_view(layer, plane)
        region = self.regions[lay.region_of_layer(layer)]
        return np.lib.stride_tricks.as_strided(region[offset:], shape=shape, strides=strides, writeable=True)

    def unlink(self) -> None:
        """Remove the segment's name now; the pages live on while any process maps them.

        Call it once the sidecar has mapped the segment (after ``RegisterCaches``): from then on
        nothing is left in /dev/shm however either process ends.
        """
        if self.owner:
            self._unlink_quietly()

    def close(self) -> None:
        """Unmap, and unlink the segment when this process created it."""
        self.regions = []
        self._segment.close()
        if self.owner:
            self._unlink_quietly()

    def _unlink_quietly(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._segment.path)

    def __enter__(self) -> SharedKVBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# ---------------------------------------------------------------------------- sidecar side
class AttachedMemory:
    """Sidecar side: a cache group's regions mapped into this process, as a :class:`RegionTable`."""

    def __init__(
        self, table: RegionTable, mem_type: str, segments: Sequence[_Segment] = (),
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
    segments: dict[str, _Segment] = {}
    bases: list[int] = []
    try:
        for i, r in enumerate(ref.regions):
            path = shm_path(r.name)
            seg = segments.get(str(path))
            if seg is None:
                try:
                    seg = _Segment(path, None, create=False)
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
    segments: dict[int, _Segment] = {}
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
                seg = segments[r.index] = _Segment(Path(f"/proc/{pid}/fd/{fds[r.index]}"), None, create=False,
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
