"""The same-host gather kernel without a GPU: its span table, its chunk search, NVRTC, and the launch.

The kernel itself runs on the lent GPU machine (bench/gpu/cuda_ipc_check.py, every byte compared
with the copy engines' result). Here: the table and the chunk -> span search it does (numpy, as a
byte-level gather against the obvious per-span copy), the kernel source compiled by the real NVRTC
(no GPU needed), and what :class:`kvxfer.cuda_driver.CudaDriver` hands the driver for one launch
(the ctypes fake of libcuda from test_cuda_ipc: there is no GPU driver here).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import cuda_gather, cuda_ipc
from kvxfer.cuda_gather import CHUNK_BYTES, KERNEL_SOURCE, Nvrtc, NvrtcError, chunk_owner, span_table
from tests.sidecar.test_cuda_ipc import FakeLibCuda

CHUNK = 64  # a small chunk for the byte-level property: many chunks per span


@st.composite
def spans(draw: Any) -> tuple[list[int], list[int], list[int], int]:
    """Disjoint destination spans gathered from anywhere in a source arena (sizes 0 and odd included)."""
    sizes = draw(st.lists(st.integers(0, 5 * CHUNK + 7), min_size=1, max_size=24))
    arena = sum(sizes) + 64
    src = [draw(st.integers(0, arena - s)) for s in sizes]
    order = draw(st.permutations(range(len(sizes))))
    dst, at = [0] * len(sizes), 0
    for i in order:  # destinations packed in a random order, with gaps
        at += draw(st.integers(0, 3))
        dst[i] = at
        at += sizes[i]
    return src, dst, sizes, max(arena, at + 1)


@given(spans())
@settings(max_examples=300, deadline=None)
def test_the_kernels_chunks_copy_exactly_what_one_copy_per_span_copies(
    case: tuple[list[int], list[int], list[int], int],
) -> None:
    src, dst, sizes, arena = case
    source = np.random.default_rng(len(sizes)).integers(0, 256, arena, dtype=np.uint8)
    want = np.zeros(arena, dtype=np.uint8)
    for s, d, z in zip(src, dst, sizes, strict=True):
        want[d : d + z] = source[s : s + z]
    u64 = np.uint64
    table, chunks = span_table(np.array(dst, u64), np.array(src, u64), np.array(sizes, u64), chunk=CHUNK)
    n = len(sizes)
    assert table.size == 4 * n + 1
    assert chunks == sum(-(-z // CHUNK) for z in sizes)
    span, off, nbytes = chunk_owner(table, n, chunk=CHUNK)
    got = np.zeros(arena, dtype=np.uint8)
    for i, o, z in zip(span.tolist(), off.tolist(), nbytes.tolist(), strict=True):
        assert 0 < z <= CHUNK  # no empty chunk: an empty span owns none
        got[dst[i] + o : dst[i] + o + z] = source[src[i] + o : src[i] + o + z]
    assert np.array_equal(got, want)
    assert int(nbytes.sum()) == sum(sizes)


def test_nvrtc_compiles_the_kernel_for_hopper_and_reports_a_bad_source() -> None:
    nvrtc = Nvrtc.load()  # a test dependency (nvidia-cuda-nvrtc-cu12): missing is a failure
    ptx = nvrtc.ptx(KERNEL_SOURCE, (9, 0)).decode()
    assert ".entry kvxfer_gather(" in ptx
    assert ".target sm_90" in ptx
    assert ".maxntid 512, 1, 1" in ptx
    with pytest.raises(NvrtcError, match=r"nvrtcCompileProgram: error \d+: .*undefined"):
        nvrtc.ptx(KERNEL_SOURCE.replace("blockDim.x;", "blockDimm.x;", 1), (9, 0))


def test_a_missing_nvrtc_names_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_gather, "find_nvrtc", lambda: ["libkvxfer-no-nvrtc.so"])
    with pytest.raises(NvrtcError, match=r"no loadable libnvrtc \(tried libkvxfer-no-nvrtc.so\); set KVXFER_NVRTC"):
        Nvrtc.load()


class KernelLib(FakeLibCuda):
    """FakeLibCuda plus the calls of one kernel launch, recorded as the driver would receive them."""

    SCRATCH = 0xD000_0000

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        c, i32 = ctypes, ctypes.c_int
        self.modules: list[bytes] = []
        self.uploads: list[tuple[int, bytes]] = []
        self.launches: list[tuple[int, int, tuple[int, int, int]]] = []
        self.allocs: list[int] = []
        self.pinned: list[Any] = []  # pinned host buffers (cuMemHostAlloc), real memory
        self.recorded: list[int] = []  # events recorded, in order
        self.busy: set[int] = set()  # events whose work has not run yet
        self.all_busy = False  # the device runs nothing: no event completes
        events = iter(range(0xE100, 0xE200))

        def cb(restype: Any, *argtypes: Any) -> Any:
            return lambda fn: self._keep.append(c.CFUNCTYPE(restype, *argtypes)(fn)) or self._keep[-1]

        def attr(p: Any, a: int, dev: int) -> int:
            p[0] = {16: 132, 75: 9, 76: 0}[a]
            return 0

        def load(p: Any, image: Any) -> int:
            self.modules.append(c.string_at(image))
            p[0] = 0x77
            return 0

        def function(p: Any, module: Any, name: bytes) -> int:
            assert (module, name) == (0x77, b"kvxfer_gather")
            p[0] = 0x88
            return 0

        def alloc(p: Any, size: int) -> int:
            self.allocs.append(size)
            p[0] = self.SCRATCH
            return 0

        def upload(dst: int, src: Any, n: int, stream: Any) -> int:
            assert stream == 0x5
            self.uploads.append((dst, src, c.string_at(src, n)))
            return 0

        def host_alloc(p: Any, size: int, flags: int) -> int:
            self.pinned.append(c.create_string_buffer(size))
            p[0] = c.addressof(self.pinned[-1])
            return 0

        def new_event(p: Any, flags: int) -> int:
            p[0] = next(events)
            return 0

        def record(ev: Any, stream: Any) -> int:
            assert stream == 0x5
            self.recorded.append(ev)
            return 0

        def launch(fn: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shm: int, stream: Any,
                   params: Any, extra: Any) -> int:  # fmt: skip
            assert (fn, gy, gz, by, bz, shm, stream, bool(extra)) == (0x88, 1, 1, 1, 1, 0, 0x5, False)
            table = c.cast(params[0], c.POINTER(c.c_uint64))[0]
            n = c.cast(params[1], c.POINTER(c.c_uint32))[0]
            chunk = c.cast(params[2], c.POINTER(c.c_uint64))[0]
            self.launches.append((gx, bx, (table, n, chunk)))
            return 0

        vp, u64 = c.c_void_p, c.c_uint64
        self.cuDeviceGetAttribute = cb(i32, c.POINTER(i32), i32, i32)(attr)
        self.cuModuleLoadData = cb(i32, c.POINTER(vp), c.c_char_p)(load)
        self.cuModuleGetFunction = cb(i32, c.POINTER(vp), vp, c.c_char_p)(function)
        self.cuMemAlloc_v2 = cb(i32, c.POINTER(u64), c.c_size_t)(alloc)
        self.cuMemFree_v2 = cb(i32, u64)(lambda p: 0)
        self.cuMemcpyHtoDAsync_v2 = cb(i32, u64, vp, c.c_size_t, vp)(upload)
        self.cuMemHostAlloc = cb(i32, c.POINTER(vp), c.c_size_t, c.c_uint)(host_alloc)
        self.cuMemFreeHost = cb(i32, vp)(lambda p: 0)
        self.cuEventCreate = cb(i32, c.POINTER(vp), c.c_uint)(new_event)
        self.cuEventRecord = cb(i32, vp, vp)(record)
        self.cuEventQuery = cb(i32, vp)(lambda ev: 600 if self.all_busy or ev in self.busy else 0)
        self.cuLaunchKernel = cb(i32, vp, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint, vp,
                                 c.POINTER(vp), c.POINTER(vp))(launch)  # fmt: skip


class FakePtx:
    """NVRTC that returns a marker instead of compiling (the real compile is tested above)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def ptx(self, source: str, arch: tuple[int, int]) -> bytes:
        assert source == KERNEL_SOURCE
        self.calls.append(arch)
        return b"// ptx for the test\n"


def test_one_launch_moves_every_span_of_a_pull() -> None:
    lib = KernelLib()
    drv = cuda_ipc.CudaDriver(lib)  # type: ignore[arg-type]
    nvrtc = FakePtx()
    drv.kernels._nvrtc = lambda: nvrtc  # type: ignore[assignment, return-value]
    u64 = np.uint64
    dst = np.array([0x1000, 0x900000, 0x2000000], u64)
    src = np.array([0x9000, 0xA000, 0x4000000], u64)
    sizes = np.array([16, 3 * CHUNK_BYTES + 1, 0], u64)
    b = drv.copy_async(0, dst, src, sizes, kernel=True)
    assert (b.how, b.calls) == ("kernel", 1)
    assert nvrtc.calls == [(9, 0)]  # compiled for the device's own compute capability
    assert lib.modules == [b"// ptx for the test\n"]
    table, chunks = span_table(dst, src, sizes)
    # The table goes up from a pinned buffer (DMA), then the launch, then the batch's event.
    (pinned,) = lib.pinned
    assert lib.uploads == [(KernelLib.SCRATCH, ctypes.addressof(pinned), table.tobytes())]
    assert lib.recorded == [b.event]
    assert b.uploads == 1
    assert lib.launches == [(chunks, 512, (KernelLib.SCRATCH, 3, CHUNK_BYTES))]  # 5 chunks: grid 5
    assert (lib.batches, lib.single) == ([], [])  # no copy-engine submission

    # Until a batch recorded after that upload is seen finished, its buffer is not written again.
    lib.busy.add(b.event)
    assert drv.done(b) is False
    b2 = drv.copy_async(0, dst[:2], src[:2], sizes[:2], kernel=True)
    assert len(lib.pinned) == 2
    assert lib.uploads[-1][1] == ctypes.addressof(lib.pinned[1])
    assert lib.uploads[-1][2] == span_table(dst[:2], src[:2], sizes[:2])[0].tobytes()
    assert lib.launches[-1] == (chunks, 512, (KernelLib.SCRATCH, 2, CHUNK_BYTES))
    assert b2.uploads == 2
    # b2 ran, so the stream ran both uploads before it: both buffers are free, though b was not polled.
    drv.wait(b2)
    b3 = drv.copy_async(0, dst, src, sizes, kernel=True)
    assert len(lib.pinned) == 2
    assert lib.uploads[-1][1] == ctypes.addressof(pinned)
    assert b3.event == b2.event  # the finished batch's event is reused
    # A batch recorded before an upload does not free its buffer: b3's upload is the third.
    lib.busy.clear()
    assert drv.done(b) is True
    b4 = drv.copy_async(0, dst, src, sizes, kernel=True)
    assert lib.uploads[-1][1] == ctypes.addressof(lib.pinned[1])  # pinned[0] still holds b3's table
    # Every pinned buffer still being read (many READs queued): the table goes up from pageable memory.
    for _ in range(cuda_gather.MAX_STAGING + 1):
        drv.copy_async(0, dst, src, sizes, kernel=True)
    assert len(lib.pinned) == cuda_gather.MAX_STAGING
    pinned_at = {ctypes.addressof(p) for p in lib.pinned}
    assert lib.uploads[-1][1] not in pinned_at
    assert lib.uploads[-1][2] == table.tobytes()
    assert (len(lib.modules), len(lib.allocs)) == (1, 1)  # loaded once, table buffer reused
    assert drv.copy_async(0, dst, src, sizes).how == "copy-engine"  # kernel=False: the copy engines
    drv.wait(b4)
    assert lib.ctx_depth == 0


class Recording:
    """A library whose functions are looked up through it, each lookup named in ``calls``."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.calls = lib, []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("cu"):
            self.calls.append(name)
        return getattr(self._lib, name)


def test_a_reads_submission_is_three_driver_calls_that_keep_the_gil_and_a_poll_is_one() -> None:
    lib = KernelLib()
    slow, fast = Recording(lib), Recording(lib)  # ctypes.CDLL and ctypes.PyDLL of one libcuda.so.1
    drv = cuda_ipc.CudaDriver(slow, fast)  # type: ignore[arg-type]
    drv.kernels._nvrtc = FakePtx  # type: ignore[assignment]
    u64 = np.uint64
    dst, src, sizes = np.array([0x1000, 0x9000], u64), np.array([0x5000, 0x7000], u64), np.array([64, 64], u64)
    drv.wait(drv.copy_async(0, dst, src, sizes, kernel=True))  # first use: context, stream, module, buffers
    assert lib.made_current == [0x1000]  # the device's primary context, made current once and left so
    slow.calls.clear()
    fast.calls.clear()
    b = drv.copy_async(0, dst, src, sizes, kernel=True)
    assert b.how == "kernel"
    assert fast.calls == ["cuCtxGetCurrent", "cuMemcpyHtoDAsync_v2", "cuLaunchKernel", "cuEventRecord"]
    fast.calls.clear()
    lib.busy.add(b.event)
    assert drv.done(b) is False
    assert fast.calls == ["cuCtxGetCurrent", "cuEventQuery"]
    assert slow.calls == []  # nothing on the way lets the GIL go: no push, no pop, no cuDeviceGet
    # Another thread's context current (a library that set its own): made ours again before any call.
    lib.current = 0x4242
    lib.busy.clear()
    assert drv.done(b) is True
    assert lib.made_current == [0x1000, 0x1000]
    # Waiting for a long batch sleeps in the driver through the library that lets the GIL go.
    synced: list[int] = []
    lib.cuEventSynchronize = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda ev: synced.append(ev) or 0)
    b = drv.copy_async(0, dst, src, sizes, kernel=True)
    lib.busy.add(b.event)
    slow.calls.clear()
    drv.wait(b)
    assert synced == [b.event]
    assert slow.calls == ["cuEventSynchronize"]
    assert lib.ctx_depth == 0


def test_without_nvrtc_the_copy_engines_move_the_pull_and_the_kernel_is_not_tried_again() -> None:
    lib = KernelLib()
    drv = cuda_ipc.CudaDriver(lib)  # type: ignore[arg-type]
    tries: list[int] = []

    def missing() -> Nvrtc:
        tries.append(1)
        raise NvrtcError("no loadable libnvrtc (tried libnvrtc.so)")

    drv.kernels._nvrtc = missing
    u64 = np.uint64
    dst, src, sizes = np.array([0x1000, 0x2000], u64), np.array([0x9000, 0xA000], u64), np.array([16, 32], u64)
    for _ in range(2):
        b = drv.copy_async(0, dst, src, sizes, kernel=True)
        assert b.how == "copy-engine"
    assert tries == [1]
    assert drv.kernels.error == "gather kernel: no loadable libnvrtc (tried libnvrtc.so)"
    assert lib.batches == [([0x1000, 0x2000], [0x9000, 0xA000], [16, 32], 1)] * 2
    assert lib.launches == []
    assert lib.ctx_depth == 0
