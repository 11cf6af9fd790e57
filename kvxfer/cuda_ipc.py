"""CUDA IPC: the process's driver binding (:func:`driver`) and the handles it opened (:data:`mappings`).

The driver calls themselves (export on the worker, open in the sidecar, device copies) are
:class:`kvxfer.cuda_driver.CudaDriver`'s; it, its records and its errors are re-exported here.

Legacy CUDA IPC shares a whole ``cudaMalloc`` allocation: a handle always names the allocation's
base, so a tensor that starts inside a larger block (PyTorch's caching allocator packs tensors into
2 MiB+ segments) travels as (handle of the block, offset of the tensor in it). The sidecar opens each
distinct handle once per process (the driver refuses to map the same handle twice) and counts its
users, so re-registering the same tensors while the old registration is still alive works.

Nothing here imports torch: the sidecar needs no CUDA runtime, only the driver that the GPU node
mounts. On a host without one, :func:`driver` raises :class:`CudaUnavailableError`, which the
sidecar answers as FAILED_PRECONDITION naming the field.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.cuda_driver import (
    HANDLE_BYTES,
    CopyBatch,
    CudaDriver,
    CudaIpcError,
    CudaUnavailableError,
    Exported,
)

__all__ = [
    "HANDLE_BYTES",
    "CopyBatch",
    "CudaDriver",
    "CudaIpcError",
    "CudaUnavailableError",
    "Exported",
    "IpcMappings",
    "driver",
    "mappings",
    "try_init",
]

LIBCUDA = "libcuda.so.1"  # the driver library; the NVIDIA container runtime mounts it


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's driver binding; raises :class:`CudaUnavailableError` without a usable driver."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBCUDA)
                fast = ctypes.PyDLL(LIBCUDA)  # the same library; its calls keep the GIL (CudaDriver)
            except OSError as exc:
                raise CudaUnavailableError(f"no CUDA driver in this process ({exc})") from None
            _driver = CudaDriver(lib, fast)
        return _driver


def try_init() -> bool:
    """Initialize the CUDA driver in this process if it has one; False without a driver or GPU.

    UCX (1.18+) asks the driver for its GPUs when a context is created and does not call cuInit
    itself: a process that creates its NIXL agent before touching CUDA gets a UCX without CUDA
    memory support ("VRAM memory is detected as host by UCX").
    """
    try:
        driver()
    except CudaUnavailableError:
        return False
    return True


@dataclass
class _Mapping:
    base: int
    size: int
    refs: int


class IpcMappings:
    """Opened handles of this process, shared by every registration and counted."""

    def __init__(self, get_driver: Callable[[], CudaDriver] | None = None) -> None:
        self._get_driver = get_driver or (lambda: driver())
        self._open: dict[tuple[int, bytes], _Mapping] = {}
        self._lock = threading.Lock()

    def driver(self) -> CudaDriver:
        """The driver these mappings use (raises :class:`CudaUnavailableError` without one)."""
        return self._get_driver()

    def acquire(self, ordinal: int, handle: bytes) -> tuple[int, int]:
        """(base, allocation bytes; 0 if unknown) of ``handle`` on device ``ordinal``, mapped on first use."""
        key = (ordinal, bytes(handle))
        with self._lock:
            m = self._open.get(key)
            if m is None:
                drv = self._get_driver()
                base = drv.open(ordinal, key[1])
                try:
                    _, size = drv.allocation_range(ordinal, base)
                except CudaIpcError:
                    size = 0  # unknown: the sizes the worker sent are then the only bound
                m = self._open[key] = _Mapping(base, size, 0)
            m.refs += 1
            return m.base, m.size

    def release(self, ordinal: int, handle: bytes) -> None:
        """Drop one use; the last one unmaps."""
        key = (ordinal, bytes(handle))
        with self._lock:
            m = self._open.get(key)
            if m is None:
                return
            m.refs -= 1
            if m.refs > 0:
                return
            del self._open[key]
            self._get_driver().close(ordinal, m.base)

    def locate(self, address: int) -> tuple[int, bytes, int] | None:
        """(device, handle, offset in the allocation) of an address inside an opened allocation."""
        with self._lock:
            for (ordinal, handle), m in self._open.items():
                if m.base <= address < m.base + max(m.size, 1):
                    return ordinal, handle, address - m.base
        return None

    def __len__(self) -> int:
        return len(self._open)


mappings = IpcMappings()
