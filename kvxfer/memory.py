"""KV memory the sidecar can reach: shared memory (CPU), CUDA IPC (GPU, not yet), or in-process.

A worker hands its KV cache to the sidecar in one of three ways:

* **Shared memory** (CPU workers): the worker keeps its cache in a POSIX shared-memory segment laid
  out in the standardized layout (one region per layer, or one for a cross-layer cache) and tells
  the sidecar the segment name and each region's offset. :class:`SharedKVBuffer` creates such a
  segment; the sidecar maps the same pages with :func:`attach` and registers them with the data
  plane, so transfers land directly in the worker's memory (no copy through the sidecar).
* **CUDA IPC** (GPU workers): handles of the worker's KV tensors, opened in the sidecar. Not
  implemented yet: :func:`attach` and :meth:`CudaIpcRef.from_tensors` raise
  :class:`UnsupportedMemoryError` naming it (the GPU data path is issue 7).
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
import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError
from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RegionTable

__all__ = [
    "ALIGNMENT",
    "AttachedMemory",
    "CudaIpcRef",
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


class UnsupportedMemoryError(KvxferError):
    """A memory kind that this build cannot register yet (CUDA IPC)."""

    status = "UNIMPLEMENTED"


CUDA_IPC_MESSAGE = (
    "CUDA IPC memory registration is not implemented yet (GPU data path, issue 7); "
    "use shared memory (CPU workers) or library mode (sidecar in the worker process)"
)


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
    """CUDA IPC handles of one cache group (one per region). Reserved for the GPU data path."""

    handles: tuple[bytes, ...]
    offsets: tuple[int, ...]
    device: int = 0

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any]) -> CudaIpcRef:
        """Export CUDA IPC handles of ``tensors``; not implemented yet."""
        raise UnsupportedMemoryError(CUDA_IPC_MESSAGE, field="memory.cuda_ipc")


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


MemoryRef = SharedMemoryRef | CudaIpcRef | LibraryRef


# ---------------------------------------------------------------------------- segments
class _Segment:
    """One mapped segment file."""

    def __init__(self, path: Path, size: int | None, *, create: bool) -> None:
        self.path = path
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
        """(num_blocks, page_bytes) view of one layer's pages (strided for a cross-layer cache)."""
        lay = self.layout
        region = self.regions[lay.region_of_layer(layer)]
        start = lay.layer_offset(layer)
        return np.lib.stride_tricks.as_strided(
            region[start:], shape=(lay.num_blocks, lay.page_bytes), strides=(lay.block_stride, 1), writeable=True
        )

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

    def __init__(self, table: RegionTable, mem_type: str, segments: Sequence[_Segment] = ()) -> None:
        self.table = table
        self.mem_type = mem_type
        self._segments = list(segments)

    @property
    def nbytes(self) -> int:
        """Bytes of all regions."""
        return int(self.table.size.sum())

    def close(self) -> None:
        """Unmap the segments (never unlinks them: the worker owns them)."""
        for s in self._segments:
            s.close()
        self._segments.clear()


def attach(ref: MemoryRef, layout: KVCacheLayout, *, field: str = "memory") -> AttachedMemory:
    """Map the memory a worker described for ``layout``; raises naming ``field`` on any mismatch."""
    if isinstance(ref, CudaIpcRef):
        raise UnsupportedMemoryError(CUDA_IPC_MESSAGE, field=f"{field}.cuda_ipc")
    if isinstance(ref, LibraryRef):
        return _attach_library(ref, layout, field)
    return _attach_shm(ref, layout, field)


def _count(n: int, layout: KVCacheLayout, where: str) -> None:
    if n != layout.num_regions:
        raise MemoryRegistrationError(
            f"{where}: the layout has {layout.num_regions} regions "
            f"({'one cross-layer region' if layout.cross_layer else 'one per layer'}), got {n}",
            field=where,
        )


def _attach_library(ref: LibraryRef, layout: KVCacheLayout, field: str) -> AttachedMemory:
    where = f"{field}.library"
    if ref.pid != os.getpid():
        raise MemoryRegistrationError(
            f"{where}.pid: library-mode addresses belong to process {ref.pid}, but this sidecar is process "
            f"{os.getpid()}; a worker in another process must use shared memory",
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
