"""What a worker sends to describe its KV memory: one reference type per way of sharing it, and the errors."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer import cuda_ipc
from kvxfer.errors import KvxferError, Reason

__all__ = [
    "CudaIpcRef", "FdLookup", "FdMemoryRef", "FdRegionRef", "LibraryRef", "MemoryRef", "MemoryRegistrationError",
    "SharedMemoryRef", "ShmRegionRef", "UnsupportedMemoryError", "shm_path",
]  # fmt: skip

SHM_DIR = Path("/dev/shm")


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
