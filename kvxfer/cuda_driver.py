"""The CUDA driver API through ctypes on ``libcuda.so.1``: the few calls kvxfer makes, in :class:`CudaDriver`.

CUDA IPC export on the worker, open and close in the sidecar, device UUIDs, and a same-host READ's
device copies (one gather kernel launch, :mod:`kvxfer.cuda_gather`, or the copy engines) with the
events that tell when they ended. :mod:`kvxfer.cuda_ipc` holds the process's one driver binding and
the handles it opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import uuid as uuid_mod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cuda_gather import GatherKernels, NvrtcError
from kvxfer.errors import KvxferError, Reason

__all__ = ["HANDLE_BYTES", "CopyBatch", "CudaDriver", "CudaIpcError", "CudaUnavailableError", "Exported"]

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_LAZY_ENABLE_PEER_ACCESS = 0x1
_ATTR_IS_LEGACY_IPC_CAPABLE = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
_ERR_NO_DEVICE = 100
_ERR_NOT_READY = 600
_STREAM_NON_BLOCKING = 0x1
_EVENT_DISABLE_TIMING = 0x2
_SRC_ACCESS_ORDER_STREAM = 0x1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


class CudaUnavailableError(KvxferError):
    """This process cannot use CUDA (no driver library, no device, driver too old)."""

    status = "FAILED_PRECONDITION"
    default_reason = Reason.UNSUPPORTED


class CudaIpcError(KvxferError):
    """A CUDA IPC call failed (handle from a dead or the same process, memory not shareable, ...)."""

    status = "FAILED_PRECONDITION"
    default_reason = Reason.MEMORY

    def __init__(self, message: str, *, code: int = 0, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.code = code


class _Handle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as bytes cut at the first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]  # fmt: skip


@dataclass(frozen=True)
class CopyBatch:
    """Device copies in flight on one device's stream; poll :meth:`CudaDriver.done`."""

    ordinal: int
    event: int
    calls: int  # driver calls it took: 1 with cuMemcpyBatchAsync, else one per copy
    how: str = "copy-engine"  # "kernel": one gather launch (kvxfer.cuda_gather); else the copy engines
    uploads: int = 0  # gather tables queued on the stream before its event: all have run once it has


@dataclass(frozen=True)
class Exported:
    """One tensor's IPC export: the handle of its allocation and where the tensor sits in it."""

    handle: bytes
    offset: int
    allocation_bytes: int


class CudaDriver:
    """The few driver calls kvxfer needs; every call runs with the device's primary context current.

    The primary context is the one PyTorch, the CUDA runtime and UCX use, so pointers opened here are
    valid for the data plane in the same process.

    ``fast`` is the same library loaded so that its calls keep the GIL (:class:`ctypes.PyDLL`): the
    calls of a same-host READ's submission and polls, which take microseconds, go through it, so
    none of them hands the GIL to another thread and waits to get it back. Calls that may block (a
    wait, a JIT load, an allocation that synchronizes) go through ``lib``, which lets other threads
    run meanwhile. On the lent H200 a READ's 8 driver calls cost 35-45 us each in the sidecar; its 3
    calls now cost about 20 us each there (1-3 us in a process that loops over them), so the GIL
    was the smaller part of it (docs/notes/gpu.md, runs 12-16).
    """

    def __init__(self, lib: ctypes.CDLL, fast: Any = None) -> None:
        self._lib = lib
        self._fast = lib if fast is None else fast
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._devices: dict[int, int] = {}  # ordinal -> CUdevice, asked once
        self._lock = threading.Lock()
        for name, argtypes in {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxPushCurrent_v2": [ctypes.c_void_p],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
            "cuMemGetAddressRange_v2": [
                ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64,
            ],
            "cuIpcGetMemHandle": [ctypes.POINTER(_Handle), ctypes.c_uint64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [ctypes.c_uint64],
            "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }.items():  # fmt: skip
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        for name, argtypes in {
            "cuStreamCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
            "cuEventCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
            "cuEventSynchronize": [ctypes.c_void_p],
            "cuEventDestroy_v2": [ctypes.c_void_p],
            "cuMemcpyDtoDAsync_v2": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
            "cuIpcOpenEventHandle": [ctypes.POINTER(ctypes.c_void_p), _Handle],
            "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
        }.items():
            fn = getattr(lib, name, None)
            if fn is not None:  # copies are optional: registration works without them
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        u64p, szp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
        attrs = ctypes.POINTER(_MemcpyAttributes)
        # CUDA 13 dropped the failIdx argument (the _v2 symbol); CUDA 12.8 has only the first form.
        self._batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        self._batch_has_fail_idx = False
        if self._batch is not None:
            self._batch.argtypes = [u64p, u64p, szp, ctypes.c_size_t, attrs, szp, ctypes.c_size_t, ctypes.c_void_p]
        elif getattr(lib, "cuMemcpyBatchAsync", None) is not None:
            self._batch, self._batch_has_fail_idx = lib.cuMemcpyBatchAsync, True
            self._batch.argtypes = [u64p, u64p, szp, ctypes.c_size_t, attrs, szp, ctypes.c_size_t, szp, ctypes.c_void_p]
        if self._batch is not None:
            self._batch.restype = ctypes.c_int
        vp = ctypes.c_void_p
        for name, argtypes in {  # the copies' hot calls, through the library that keeps the GIL
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuEventRecord": [vp, vp],
            "cuEventQuery": [vp],
        }.items():
            fn = getattr(self._fast, name, None)
            if fn is not None:  # optional like the copies they serve
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        self.batch_error = ""  # why batched copies were given up, if they were
        self.kernels = GatherKernels(lib, self._check, fast=self._fast)  # one launch per pull (kvxfer.cuda_gather)
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._events: dict[int, list[int]] = {}  # per device: events of finished batches, reused (no create per READ)
        self._scratch: dict[int, tuple[Any, Any, Any]] = {}  # per device: a rehearsal's (dst, src, sizes)
        uuid_fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        uuid_fn.argtypes = [ctypes.POINTER(_Uuid), ctypes.c_int]
        uuid_fn.restype = ctypes.c_int
        self._uuid_fn = uuid_fn
        rc = lib.cuInit(0)
        if rc == _ERR_NO_DEVICE:
            raise CudaUnavailableError("no CUDA device is visible to this process (cuInit: CUDA_ERROR_NO_DEVICE)")
        if rc:
            raise CudaUnavailableError(f"the CUDA driver did not initialize (cuInit: {self.error_text(rc)})")

    # ------------------------------------------------------------------ basics
    def error_text(self, rc: int) -> str:
        """``NAME (description)`` of a driver error code."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(name))
        self._lib.cuGetErrorString(rc, ctypes.byref(text))
        n = name.value.decode() if name.value else f"CUDA error {rc}"
        return f"{n} ({text.value.decode()})" if text.value else n

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise CudaIpcError(f"{what}: {self.error_text(rc)}", code=rc)

    def device_count(self) -> int:
        """Devices visible to this process."""
        n = ctypes.c_int()
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return int(n.value)

    def device_uuid(self, ordinal: int) -> str:
        """``GPU-xxxxxxxx-...`` as nvidia-smi prints it; stable across CUDA_VISIBLE_DEVICES renumbering."""
        dev = self._device(ordinal)
        u = _Uuid()
        self._check(self._uuid_fn(ctypes.byref(u), dev), "cuDeviceGetUuid")
        return "GPU-" + str(uuid_mod.UUID(bytes=bytes(u.bytes)))

    def _device(self, ordinal: int) -> int:
        dev = self._devices.get(ordinal)
        if dev is None:
            out = ctypes.c_int()
            self._check(self._lib.cuDeviceGet(ctypes.byref(out), int(ordinal)), f"cuDeviceGet({ordinal})")
            dev = self._devices[ordinal] = int(out.value)
        return dev

    def _primary(self, ordinal: int) -> ctypes.c_void_p:
        """The device's primary context, retained on first use and kept for the process's life (as the runtime does)."""
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            with self._lock:
                ctx = self._ctx.get(ordinal)
                if ctx is None:
                    ctx = ctypes.c_void_p()
                    dev = self._device(ordinal)
                    self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                    self._ctx[ordinal] = ctx
        return ctx

    @contextlib.contextmanager
    def _current(self, ordinal: int) -> Iterator[None]:
        """The device's primary context, current on this thread for the block (rare calls)."""
        ctx = self._primary(ordinal)
        self._check(self._lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def _make_current(self, ordinal: int) -> None:
        """Make the device's primary context current on this thread, and leave it so (the hot path).

        One cheap call when it already is (a thread-local read in the driver), instead of a push and
        a pop around every call: the sidecar's threads use no other context, and the CUDA runtime
        too leaves a thread's context current.
        """
        ctx = self._primary(ordinal)
        cur = ctypes.c_void_p()
        self._fast.cuCtxGetCurrent(ctypes.byref(cur))
        if cur.value != ctx.value:
            self._check(self._fast.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def allocation_range(self, ordinal: int, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that holds device address ``ptr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._current(ordinal):
            rc = self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        self._check(rc, f"cuMemGetAddressRange(0x{ptr:x})")
        return int(base.value), int(size.value)

    # ------------------------------------------------------------------ worker side
    def export(self, ordinal: int, ptr: int) -> Exported:
        """IPC handle of the allocation holding ``ptr`` on device ``ordinal``, and ``ptr``'s offset in it."""
        capable = ctypes.c_int(1)
        h = _Handle()
        base, size = self.allocation_range(ordinal, ptr)
        with self._current(ordinal):
            # Drivers that do not know the attribute answer an error: then only cuIpcGetMemHandle decides.
            attr = self._lib.cuPointerGetAttribute(ctypes.byref(capable), _ATTR_IS_LEGACY_IPC_CAPABLE, ptr)
            rc = self._lib.cuIpcGetMemHandle(ctypes.byref(h), base)
        if attr == 0 and not capable.value:
            raise CudaIpcError(
                "the memory was not allocated with cudaMalloc (e.g. cuMemCreate/VMM, or PyTorch with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), so legacy CUDA IPC cannot share it"
            )
        self._check(rc, "cuIpcGetMemHandle")
        return Exported(bytes(h.reserved), ptr - base, size)

    # ------------------------------------------------------------------ sidecar side
    def open(self, ordinal: int, handle: bytes) -> int:
        """Map another process's allocation; returns its base address in this process."""
        h = _Handle()
        ctypes.memmove(ctypes.byref(h), handle, HANDLE_BYTES)
        ptr = ctypes.c_uint64()
        with self._current(ordinal):
            rc = self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS)
        self._check(rc, "cuIpcOpenMemHandle")
        return int(ptr.value)

    def open_event(self, ordinal: int, handle: bytes) -> int:
        """Open another process's interprocess event (``cudaIpcGetEventHandle``); returns the CUevent."""
        h = _Handle()
        ctypes.memmove(ctypes.byref(h), handle, HANDLE_BYTES)
        ev = ctypes.c_void_p()
        with self._current(ordinal):
            rc = self._lib.cuIpcOpenEventHandle(ctypes.byref(ev), h)
        self._check(rc, "cuIpcOpenEventHandle")
        return int(ev.value or 0)

    def sync_event(self, ordinal: int, event: int) -> None:
        """Block until the work recorded in ``event`` (by any process) has completed."""
        with self._current(ordinal):
            rc = self._lib.cuEventSynchronize(ctypes.c_void_p(event))
        self._check(rc, "cuEventSynchronize")

    def close(self, ordinal: int, ptr: int) -> None:
        """Unmap what :meth:`open` mapped."""
        with self._current(ordinal):
            rc = self._lib.cuIpcCloseMemHandle(ptr)
        self._check(rc, "cuIpcCloseMemHandle")

    # ------------------------------------------------------------------ copies (same-node data path)
    def copy_async(self, ordinal: int, dst: npt.NDArray[np.uint64], src: npt.NDArray[np.uint64],
                   sizes: npt.NDArray[np.uint64], *, kernel: bool = False) -> CopyBatch:  # fmt: skip
        """Queue ``dst[i] <- src[i]`` (``sizes[i]`` bytes) on device ``ordinal``'s stream; returns at once.

        With ``kernel``, one launch of the gather kernel (:mod:`kvxfer.cuda_gather`) moves every
        span; if it cannot be built or loaded, the copy engines do (``kernels.error`` says why).
        Copy engines: one ``cuMemcpyBatchAsync`` call where the driver has it (CUDA >= 12.8), else
        one ``cuMemcpyDtoDAsync`` per copy (about 2 us of CPU each).
        """
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        n = int(dst.size)
        self._make_current(ordinal)
        stream = self._streams.get(ordinal)
        if stream is None:
            stream = ctypes.c_void_p()
            self._check(self._lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
            self._streams[ordinal] = stream
        calls, how = 1, "copy-engine"
        if kernel and self.kernels.available and self._gather(ordinal, stream, dst, src, sizes):
            how = "kernel"
        elif not (self._batch is not None and n > 1 and self._copy_batched(dst, src, sizes, stream)):
            calls = n
            cpy = self._lib.cuMemcpyDtoDAsync_v2
            for d, sr, sz in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                rc = cpy(d, sr, sz, stream)
                if rc:
                    self._check(rc, f"cuMemcpyDtoDAsync(0x{d:x} <- 0x{sr:x}, {sz})")
        free = self._events.setdefault(ordinal, [])
        ev = ctypes.c_void_p(free.pop()) if free else ctypes.c_void_p()
        if not ev.value:
            self._check(self._lib.cuEventCreate(ctypes.byref(ev), _EVENT_DISABLE_TIMING), "cuEventCreate")
        self._check(self._fast.cuEventRecord(ev, stream), "cuEventRecord")
        return CopyBatch(ordinal, int(ev.value or 0), calls, how, self.kernels.uploads(ordinal))

    def rehearse(self, ordinal: int) -> None:
        """Run one gather of 16 bytes between two scratch bytes of device ``ordinal`` and wait for it.

        The same calls as a pull's gather (table, upload, launch, event, poll), moving nothing that
        matters: a worker runs it while it waits for its sidecar's answer, so that the gather which
        follows the answer finds the code it runs warm. On the lent machines code that has not run
        for a millisecond or more runs 3-8x slower (docs/notes/gpu.md, runs 35-38).
        """
        scratch = self._scratch.get(ordinal)
        if scratch is None:
            ptr = ctypes.c_uint64()
            with self._current(ordinal):
                self._check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), 64), "cuMemAlloc(rehearsal)")
            scratch = self._scratch[ordinal] = (
                np.array([ptr.value + 32], dtype=np.uint64), np.array([ptr.value], dtype=np.uint64),
                np.array([16], dtype=np.uint64),
            )  # fmt: skip
        batch = self.copy_async(ordinal, *scratch, kernel=True)
        until = time.perf_counter() + 0.01
        while not self.done(batch):
            if time.perf_counter() > until:
                self.wait(batch)
                return

    def _finished(self, batch: CopyBatch, rc: int) -> None:
        """Give ``batch``'s event back for the next batch, and the table buffers it covers to the kernels.

        The caller holds its context current. The stream runs in order, so every table upload
        queued before the batch's event has run once the event has.
        """
        self.kernels.ran(batch.ordinal, batch.uploads)
        if rc == 0:
            self._events.setdefault(batch.ordinal, []).append(batch.event)  # list.append: atomic across threads
        else:
            self._lib.cuEventDestroy_v2(ctypes.c_void_p(batch.event))

    def _gather(self, ordinal: int, stream: ctypes.c_void_p, dst: Any, src: Any, sizes: Any) -> bool:
        """Launch the gather kernel; False (and the kernel given up) if it cannot be built or queued."""
        try:
            self.kernels.launch(ordinal, self._device(ordinal), stream, dst, src, sizes)
        except (NvrtcError, CudaIpcError, AttributeError, OSError) as exc:
            # Nothing of this pull was queued (a failed table upload is overwritten before any launch).
            self.kernels.forget(f"gather kernel: {exc}")
            return False
        return True

    def _copy_batched(self, dst: Any, src: Any, sizes: Any, stream: ctypes.c_void_p) -> bool:
        u64p, szp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
        attr = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        idx = (ctypes.c_size_t * 1)(0)
        args: list[Any] = [dst.ctypes.data_as(u64p), src.ctypes.data_as(u64p), sizes.ctypes.data_as(szp),
                           int(dst.size), ctypes.byref(attr), idx, 1]  # fmt: skip
        if self._batch_has_fail_idx:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        assert self._batch is not None
        rc = self._batch(*args, stream)
        if rc:
            # Nothing was queued; remember why and use single copies from now on.
            self.batch_error = f"cuMemcpyBatchAsync: {self.error_text(rc)}"
            self._batch = None
            return False
        return True

    def wait(self, batch: CopyBatch) -> None:
        """Block until the copies of ``batch`` finished (raises if they failed) and give its event back.

        Meant for a worker thread (the call releases the GIL): it waits in ``cuEventSynchronize``,
        which may yield or sleep by the context's scheduling flags. A same-host READ is first polled
        from the event loop with :meth:`done` (kvxfer.transport.cuda_ipc_direct); only a long one
        gets here.
        """
        ev = ctypes.c_void_p(batch.event)
        self._make_current(batch.ordinal)
        rc = self._fast.cuEventQuery(ev)
        if rc == _ERR_NOT_READY:
            rc = self._lib.cuEventSynchronize(ev)  # lets the GIL go while it sleeps
        self._finished(batch, rc)
        self._check(rc, "device copies")

    def done(self, batch: CopyBatch) -> bool:
        """Whether the copies of ``batch`` finished (raises if they failed); gives its event back when they did.

        One driver call when the thread's context is already the device's (the event loop polls this).
        """
        self._make_current(batch.ordinal)
        rc = self._fast.cuEventQuery(ctypes.c_void_p(batch.event))
        if rc == _ERR_NOT_READY:
            return False
        self._finished(batch, rc)
        self._check(rc, "device copies")
        return True
