"""One kernel launch per pull: a byte gather over (source, destination, length) spans on one GPU.

A fragmented pull of a paged KV cache is hundreds to thousands of spans (one per run of blocks per
layer). The copy engines take 3-5 us of GPU time per span however they are submitted (one
``cuMemcpyDtoDAsync`` each or one ``cuMemcpyBatchAsync``), so a 1 GiB pull of 944 spans ran at 0.11
of the device's copy rate on the lent H200. This kernel moves every span of a pull in one launch:
the span table goes to the device with one host-to-device copy on the same stream, each thread
block copies 64 KiB chunks (found by binary search in the table's chunk prefix), 16 bytes per
thread per access where source, destination and length allow it, byte by byte otherwise.

The kernel is compiled at first use by NVRTC (``libnvrtc``: the CUDA toolkit's, or the
``nvidia-cuda-nvrtc`` wheel PyTorch installs) for the device's own architecture, and loaded with
the driver API; nothing here imports torch. Without NVRTC, or if compiling or loading fails, the
caller keeps the copy engines (:attr:`GatherKernels.error` says why) and the pull still completes.

:func:`span_table` (pure numpy) builds what the kernel reads; :func:`chunk_owner` is the kernel's
chunk -> span search in numpy, for tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHUNK_BYTES", "KERNEL_SOURCE", "GatherKernels", "Nvrtc", "chunk_owner", "fill_span_table", "find_nvrtc",
    "span_table",
]  # fmt: skip

U64 = npt.NDArray[np.uint64]

CHUNK_BYTES = 64 << 10  # bytes one thread block copies at a time: 4,096 16-byte words for 512 threads
THREADS = 512
BLOCKS_PER_SM = 16  # enough resident work to cover memory latency; more blocks only loop more

KERNEL_NAME = "kvxfer_gather"
KERNEL_SOURCE = r"""
typedef unsigned long long u64;

// table: src[n] | dst[n] | len[n] | first[n + 1], where first[i] is the first 64 KiB chunk of span i.
extern "C" __global__ void __launch_bounds__(512) kvxfer_gather(const u64* __restrict__ table, unsigned int n,
                                                                u64 chunk) {
  const u64* src = table;
  const u64* dst = table + n;
  const u64* len = table + 2 * (u64)n;
  const u64* first = table + 3 * (u64)n;
  const u64 total = first[n];
  const unsigned int step = blockDim.x;
  for (u64 c = blockIdx.x; c < total; c += gridDim.x) {
    unsigned int lo = 0, hi = n;  // the last span whose first chunk is <= c (empty spans own none)
    while (hi - lo > 1) {
      const unsigned int mid = (lo + hi) >> 1;
      if (first[mid] <= c) lo = mid; else hi = mid;
    }
    const u64 off = (c - first[lo]) * chunk;
    const u64 rest = len[lo] - off;
    const u64 nbytes = rest < chunk ? rest : chunk;
    const char* s = (const char*)src[lo] + off;
    char* d = (char*)dst[lo] + off;
    if ((((u64)s | (u64)d | nbytes) & 15) == 0) {
      const uint4* s4 = (const uint4*)s;
      uint4* d4 = (uint4*)d;
      const u64 words = nbytes >> 4;
      u64 i = threadIdx.x;
      for (; i + 3 * step < words; i += 4 * step) {  // four loads in flight per thread before any store
        const uint4 a = s4[i], b = s4[i + step], e = s4[i + 2 * step], f = s4[i + 3 * step];
        d4[i] = a; d4[i + step] = b; d4[i + 2 * step] = e; d4[i + 3 * step] = f;
      }
      for (; i < words; i += step) d4[i] = s4[i];
    } else {
      for (u64 i = threadIdx.x; i < nbytes; i += step) d[i] = s[i];
    }
  }
}
"""


def span_table(dst: U64, src: U64, sizes: U64, chunk: int = CHUNK_BYTES) -> tuple[U64, int]:
    """The kernel's table (``src | dst | len | first``) and its total number of chunks."""
    table = np.empty(4 * int(np.size(sizes)) + 1, dtype=np.uint64)
    return table, fill_span_table(table, dst, src, sizes, chunk)


def fill_span_table(out: U64, dst: U64, src: U64, sizes: U64, chunk: int = CHUNK_BYTES) -> int:
    """Write the kernel's table for ``n`` spans into ``out[: 4 * n + 1]``; returns its number of chunks."""
    n = int(np.size(sizes))
    out[:n] = src
    out[n : 2 * n] = dst
    lens = out[2 * n : 3 * n]
    lens[:] = sizes
    out[3 * n] = 0
    first = out[3 * n + 1 : 4 * n + 1]
    np.floor_divide(lens + np.uint64(chunk - 1), np.uint64(chunk), out=first)
    np.cumsum(first, out=first)
    return int(out[4 * n])


def chunk_owner(table: U64, n: int, chunk: int = CHUNK_BYTES) -> tuple[npt.NDArray[np.int64], U64, U64]:
    """For every chunk: (span index, byte offset in the span, bytes), as the kernel finds them."""
    first, lens = table[3 * n :], table[2 * n : 3 * n]
    c = np.arange(int(first[-1]), dtype=np.uint64)
    span = np.searchsorted(first, c, side="right").astype(np.int64) - 1
    off = (c - first[span]) * np.uint64(chunk)
    return span, off, np.minimum(lens[span] - off, np.uint64(chunk))


# ---------------------------------------------------------------------------------------------- NVRTC
def find_nvrtc() -> list[str]:
    """Where libnvrtc may be: ``KVXFER_NVRTC``, the loader's path, the NVIDIA wheels in sys.path."""
    names = [os.environ.get("KVXFER_NVRTC", "")]
    found = ctypes.util.find_library("nvrtc")
    names += [found or "", "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for root in sys.path:
        for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            names += sorted(p for p in glob.glob(os.path.join(root, pattern)) if "builtins" not in p)
    return [n for n in dict.fromkeys(names) if n]


class NvrtcError(RuntimeError):
    """NVRTC is missing or did not compile the kernel (the message says which, and the log)."""


class Nvrtc:
    """The six NVRTC calls that compile one source to PTX."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        vp, cp, szp = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)
        for name, argtypes in {
            "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
            "nvrtcCreateProgram": [ctypes.POINTER(vp), cp, cp, ctypes.c_int, vp, vp],
            "nvrtcCompileProgram": [vp, ctypes.c_int, ctypes.POINTER(cp)],
            "nvrtcGetPTXSize": [vp, szp],
            "nvrtcGetPTX": [vp, cp],
            "nvrtcGetProgramLogSize": [vp, szp],
            "nvrtcGetProgramLog": [vp, cp],
            "nvrtcDestroyProgram": [ctypes.POINTER(vp)],
        }.items():  # fmt: skip
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls) -> Nvrtc:
        """The first libnvrtc of :func:`find_nvrtc` that loads; :class:`NvrtcError` if none does."""
        tried = find_nvrtc()
        for path in tried:
            try:
                return cls(ctypes.CDLL(path), path)
            except (OSError, AttributeError):
                continue
        raise NvrtcError(f"no loadable libnvrtc (tried {', '.join(tried)}); set KVXFER_NVRTC to its path")

    def version(self) -> tuple[int, int]:
        """NVRTC's (major, minor)."""
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return int(major.value), int(minor.value)

    def ptx(self, source: str, arch: tuple[int, int]) -> bytes:
        """PTX of ``source`` for compute capability ``arch`` (the driver JIT-compiles it when loading)."""
        prog = ctypes.c_void_p()
        rc = self._lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kvxfer_gather.cu", 0, None, None)
        if rc:
            raise NvrtcError(f"nvrtcCreateProgram: error {rc}")
        try:
            opts = [f"--gpu-architecture=compute_{arch[0]}{arch[1]}".encode(), b"-default-device", b"-lineinfo"]
            argv = (ctypes.c_char_p * len(opts))(*opts)
            rc = self._lib.nvrtcCompileProgram(prog, len(opts), argv)
            if rc:
                n = ctypes.c_size_t()
                self._lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
                text = ctypes.create_string_buffer(n.value)
                self._lib.nvrtcGetProgramLog(prog, text)
                raise NvrtcError(f"nvrtcCompileProgram: error {rc}: {text.value.decode(errors='replace')[:2000]}")
            n = ctypes.c_size_t()
            self._lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
            out = ctypes.create_string_buffer(n.value)
            self._lib.nvrtcGetPTX(prog, out)
            return out.raw
        finally:
            self._lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---------------------------------------------------------------------------------------------- driver side
_ATTR_SM_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_ATTR_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
_ATTR_CC_MINOR = 76

MAX_STAGING = 8  # pinned table buffers per device: one per READ whose table upload may still be queued


@dataclass
class _Staging:
    """A pinned host buffer for span tables: uploads from it are DMA, and the host call returns at once.

    The device may still read it after :meth:`GatherKernels.launch` returns, so it is written again
    only once a batch recorded after its upload (``seq``) was seen finished (:meth:`GatherKernels.ran`):
    the stream runs in order, so that needs no event of its own.
    """

    host: int
    words: U64  # a numpy view of the whole buffer
    seq: int = 0  # the upload's number on the device's stream (1, 2, ...)
    busy: bool = False


@dataclass
class _Loaded:
    function: ctypes.c_void_p
    sms: int
    scratch: int = 0  # device buffer for the span table
    scratch_bytes: int = 0
    staging: list[_Staging] = field(default_factory=list)
    uploads: int = 0  # table uploads queued on the device's stream so far
    # The launch's arguments, made once: each launch only sets their values (the driver copies them).
    table_arg: ctypes.c_uint64 = field(default_factory=ctypes.c_uint64)
    spans_arg: ctypes.c_uint32 = field(default_factory=ctypes.c_uint32)
    chunk_arg: ctypes.c_uint64 = field(default_factory=lambda: ctypes.c_uint64(CHUNK_BYTES))
    params: Any = None

    def __post_init__(self) -> None:
        args = (self.table_arg, self.spans_arg, self.chunk_arg)
        self.params = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))


class GatherKernels:
    """The gather kernel per device, loaded into the primary context on first use.

    ``lib`` is the driver library (``libcuda.so.1``) of :class:`kvxfer.cuda_driver.CudaDriver` and
    ``check`` its error check; ``fast`` the same library with calls that keep the GIL (the two calls
    of a launch go through it). The caller makes the device's primary context (where the IPC
    mappings live) current around :meth:`launch`. ``nvrtc`` gives the compiler (tests pass their own).
    """

    def __init__(self, lib: ctypes.CDLL, check: Callable[[int, str], None],
                 nvrtc: Callable[[], Nvrtc] = Nvrtc.load, *, fast: Any = None) -> None:  # fmt: skip
        self._lib = lib
        self._fast = lib if fast is None else fast
        self._check = check
        self._nvrtc = nvrtc
        self._loaded: dict[int, _Loaded] = {}
        self._bound = False
        # A batch may be seen finished on a waiter thread while the event loop takes a buffer.
        self._slots = threading.Lock()
        self.error = ""  # why the kernel is not used, once it failed to build or load
        self.last_us = (0.0, 0.0, 0.0)  # the last launch's table / upload / launch microseconds (debug logs)

    def _bind(self) -> None:
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        launch_args = [vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]  # fmt: skip
        for lib, table in (
            (self._lib, {
                "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
                "cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
                "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
                "cuMemAlloc_v2": [ctypes.POINTER(u64), ctypes.c_size_t],
                "cuMemFree_v2": [u64],
                "cuMemHostAlloc": [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint],
                "cuMemFreeHost": [vp],
            }),
            (self._fast, {"cuMemcpyHtoDAsync_v2": [u64, vp, ctypes.c_size_t, vp], "cuLaunchKernel": launch_args}),
        ):  # fmt: skip
            for name, argtypes in table.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        self._bound = True

    @property
    def available(self) -> bool:
        """False once building or loading the kernel failed (then :attr:`error` says why)."""
        return not self.error

    def _attr(self, attr: int, device: int) -> int:
        v = ctypes.c_int()
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(v), attr, device), "cuDeviceGetAttribute")
        return int(v.value)

    def _load(self, ordinal: int, device: int) -> _Loaded:
        """Compile (NVRTC) and load the kernel for ``ordinal``; the caller holds its context current."""
        arch = (self._attr(_ATTR_CC_MAJOR, device), self._attr(_ATTR_CC_MINOR, device))
        ptx = self._nvrtc().ptx(KERNEL_SOURCE, arch)
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._lib.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData(gather kernel)")
        self._check(self._lib.cuModuleGetFunction(ctypes.byref(fn), module, KERNEL_NAME.encode()),
                    "cuModuleGetFunction")  # fmt: skip
        loaded = self._loaded[ordinal] = _Loaded(fn, self._attr(_ATTR_SM_COUNT, device))
        return loaded

    def launch(self, ordinal: int, device: int, stream: ctypes.c_void_p, dst: U64, src: U64, sizes: U64) -> None:
        """Queue the gather of every span on ``stream``; the caller holds ``ordinal``'s context current.

        Two driver calls once loaded: the table's upload and the launch. Raises whatever building,
        loading or queuing raised; nothing was queued then.
        """
        t0 = time.perf_counter()
        if not self._bound:
            self._bind()
        k = self._loaded.get(ordinal) or self._load(ordinal, device)
        words = 4 * int(sizes.size) + 1
        slot = self._staging(k, words)
        if slot is not None:
            chunks = fill_span_table(slot.words, dst, src, sizes)
            host, nbytes = slot.host, words * 8
        else:
            table, chunks = span_table(dst, src, sizes)
            host, nbytes = table.ctypes.data, table.nbytes
        t1 = time.perf_counter()
        if chunks == 0:
            self._release(slot)
            return
        if nbytes > k.scratch_bytes:
            # cuMemFree waits until the device is idle, so no queued launch still reads the old
            # table; acceptable for a buffer that only ever grows.
            if k.scratch:
                self._lib.cuMemFree_v2(k.scratch)
                k.scratch, k.scratch_bytes = 0, 0
            ptr, size = ctypes.c_uint64(), max(nbytes, 64 << 10)
            rc = self._lib.cuMemAlloc_v2(ctypes.byref(ptr), size)
            if rc:
                self._release(slot)
                self._check(rc, "cuMemAlloc(gather table)")
            k.scratch, k.scratch_bytes = int(ptr.value), size
        # From pinned memory the copy is DMA, queued; the buffer is not written again before a batch
        # recorded after it was seen finished. From pageable memory (no buffer free) the driver
        # stages the bytes before returning. Either way, launches after it on the stream see the new table.
        rc = self._fast.cuMemcpyHtoDAsync_v2(k.scratch, host, nbytes, stream)
        if rc:
            self._release(slot)
            self._check(rc, "cuMemcpyHtoDAsync(gather table)")
        k.uploads += 1
        if slot is not None:
            slot.seq = k.uploads
        t2 = time.perf_counter()
        k.table_arg.value, k.spans_arg.value = k.scratch, int(sizes.size)
        grid = max(1, min(chunks, k.sms * BLOCKS_PER_SM))
        self._check(self._fast.cuLaunchKernel(k.function, grid, 1, 1, THREADS, 1, 1, 0, stream, k.params, None),
                    "cuLaunchKernel(gather)")  # fmt: skip
        self.last_us = ((t1 - t0) * 1e6, (t2 - t1) * 1e6, (time.perf_counter() - t2) * 1e6)

    def uploads(self, ordinal: int) -> int:
        """Table uploads queued so far on ``ordinal``'s stream (a batch recorded now comes after all of them)."""
        k = self._loaded.get(ordinal)
        return k.uploads if k is not None else 0

    def ran(self, ordinal: int, uploads: int) -> None:
        """A batch recorded after the first ``uploads`` table uploads finished: their buffers are free again."""
        k = self._loaded.get(ordinal)
        if k is None:
            return
        with self._slots:
            for slot in k.staging:
                if slot.busy and slot.seq <= uploads:
                    slot.busy = False

    def _release(self, slot: _Staging | None) -> None:
        """Give back a buffer whose upload was never queued."""
        if slot is not None:
            with self._slots:
                slot.busy = False

    def _staging(self, k: _Loaded, words: int) -> _Staging | None:
        """A free pinned buffer of at least ``words`` u64, now taken; None: use pageable memory."""
        with self._slots:
            for slot in k.staging:
                if not slot.busy and slot.words.size >= words:
                    slot.busy, slot.seq = True, k.uploads + 1  # not freed by a batch recorded before its upload
                    return slot
        if len(k.staging) >= MAX_STAGING:
            return None  # every buffer is still being read: many READs queued at once
        nbytes = max(64 << 10, 1 << (words * 8 - 1).bit_length())
        host = ctypes.c_void_p()
        if self._lib.cuMemHostAlloc(ctypes.byref(host), nbytes, 0) or not host.value:
            return None  # no pinned memory to be had: the pageable upload still works
        view = np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(host.value))
        slot = _Staging(int(host.value), view, k.uploads + 1, busy=True)
        with self._slots:
            k.staging.append(slot)
        return slot

    def forget(self, reason: str) -> None:
        """Stop using the kernel (the caller falls back to the copy engines)."""
        self.error = reason
