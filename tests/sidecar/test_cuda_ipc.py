"""CUDA IPC registration without a GPU: validation, errors, and the mapping bookkeeping (fake driver).

The real driver path runs on the lent GPU machine (bench/gpu/cuda_ipc_check.py); these tests pin
everything around it: what a worker sends, what the sidecar refuses and with which status and field,
that each allocation is mapped once however many regions or registrations use it, and that every
mapping is closed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import cuda_driver, cuda_ipc
from kvxfer.cuda_ipc import CudaIpcError, CudaUnavailableError, Exported, IpcMappings
from kvxfer.errors import KvxferError
from kvxfer.memory import CudaIpcRef, MemoryRegistrationError, attach
from kvxfer.transport import MemType, Notification, Op, Registration, TransferResult, Transport, TransportConfig
from kvxfer.transport.base import CudaGather
from kvxfer.transport.cuda_ipc_direct import CudaIpcDirect
from kvxfer.transport.nixl_agent import UCX_DEFAULTS, ucx_engine_config
from kvxfer.wire.convert import memory_from_proto, memory_to_proto
from tests.sidecar.helpers import Harness, attention, expect_error

LAY = attention(layers=4, blocks=8)  # region_bytes = 8 blocks * 8 heads * 16 tokens * 2 * 64 * 2 bytes
UUIDS = ("GPU-00000000-0000-0000-0000-00000000000a", "GPU-00000000-0000-0000-0000-00000000000b")


def handle(n: int) -> bytes:
    return bytes([n]) * cuda_ipc.HANDLE_BYTES


@dataclass
class FakeDriver:
    """Two GPUs; allocation ``handle(n)`` lives at 0x1000_0000 * n and has ``alloc_bytes`` bytes."""

    alloc_bytes: int = 1 << 30
    fail_open: set[bytes] = field(default_factory=set)
    fail_devices: set[int] = field(default_factory=set)
    opened: list[tuple[int, bytes]] = field(default_factory=list)
    closed: list[tuple[int, int]] = field(default_factory=list)

    def device_count(self) -> int:
        return len(UUIDS)

    def device_uuid(self, ordinal: int) -> str:
        return UUIDS[ordinal]

    def open(self, ordinal: int, h: bytes) -> int:
        if h in self.fail_open or ordinal in self.fail_devices:
            raise CudaIpcError("cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE (invalid argument)", code=1)
        self.opened.append((ordinal, h))
        return 0x1000_0000 * h[0]

    def allocation_range(self, ordinal: int, ptr: int) -> tuple[int, int]:
        return ptr, self.alloc_bytes

    def close(self, ordinal: int, ptr: int) -> None:
        self.closed.append((ordinal, ptr))

    def export(self, ordinal: int, ptr: int) -> Exported:
        return Exported(handle(ptr >> 28), ptr & 0xFFF_FFFF, self.alloc_bytes)

    copies: list[tuple[int, list[int], list[int], list[int]]] = field(default_factory=list)

    kernel_flags: list[bool] = field(default_factory=list)

    def copy_async(self, ordinal: int, dst: Any, src: Any, sizes: Any, *, kernel: bool = False) -> cuda_ipc.CopyBatch:
        self.copies.append((ordinal, [int(x) for x in dst], [int(x) for x in src], [int(x) for x in sizes]))
        self.kernel_flags.append(kernel)
        return cuda_ipc.CopyBatch(ordinal, len(self.copies), 1, "kernel" if kernel else "copy-engine")

    not_ready: int = 0  # polls of each batch that find it still running
    polls: int = 0
    waits: list[int] = field(default_factory=list)  # batches a thread waited for in the driver

    def done(self, batch: cuda_ipc.CopyBatch) -> bool:
        self.polls += 1
        return self.polls > self.not_ready

    def wait(self, batch: cuda_ipc.CopyBatch) -> None:
        self.waits.append(batch.event)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(cuda_ipc, "mappings", IpcMappings(lambda: drv))  # type: ignore[arg-type, return-value]
    monkeypatch.setattr(cuda_ipc, "driver", lambda: drv)
    return drv


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has no libcuda.so.1, whatever the machine has."""

    monkeypatch.setattr(cuda_ipc, "_driver", None)
    monkeypatch.setattr(cuda_ipc, "LIBCUDA", "libkvxfer-test-no-cuda.so.1")
    monkeypatch.setattr(cuda_ipc, "mappings", IpcMappings())


def ref(**kw: Any) -> CudaIpcRef:
    n = LAY.num_regions
    base = dict(handles=tuple(handle(1) for _ in range(n)), offsets=tuple(i * LAY.region_bytes for i in range(n)),
                device=0, sizes=(LAY.region_bytes,) * n, device_uuid="")  # fmt: skip
    return CudaIpcRef(**{**base, **kw})  # type: ignore[arg-type]


class FakeCudaTensor:
    """What from_tensors reads of a CUDA tensor, backed by a CPU tensor's shape and strides."""

    is_cuda = True

    def __init__(self, t: torch.Tensor, ptr: int, device: int = 0) -> None:
        self._t, self._ptr, self.device = t, ptr, torch.device("cuda", device)
        self.shape = t.shape

    def numel(self) -> int:
        return self._t.numel()

    def stride(self) -> tuple[int, ...]:
        return self._t.stride()

    def element_size(self) -> int:
        return self._t.element_size()

    def data_ptr(self) -> int:
        return self._ptr


# ---------------------------------------------------------------------------- worker side
def test_from_tensors_refuses_cpu_and_empty() -> None:
    with pytest.raises(MemoryRegistrationError, match=r"memory.cuda_ipc: tensor 1 is on cpu, not a CUDA device"):
        CudaIpcRef.from_tensors([FakeCudaTensor(torch.zeros(4), 0x1000_0000), torch.zeros(4)])
    with pytest.raises(MemoryRegistrationError, match="no tensors given"):
        CudaIpcRef.from_tensors([])


def test_from_tensors_exports_offsets_sizes_and_uuid(fake: FakeDriver) -> None:
    per_layer = [
        FakeCudaTensor(torch.zeros(8, 16, 64, dtype=torch.bfloat16), 0x1000_0000 + i * 0x4000) for i in range(3)
    ]
    r = CudaIpcRef.from_tensors(per_layer)
    assert r.handles == (handle(1),) * 3
    assert r.offsets == (0, 0x4000, 0x8000)
    assert r.sizes == (8 * 16 * 64 * 2,) * 3
    assert (r.device, r.device_uuid) == (0, UUIDS[0])
    # A cross-layer cache is a permuted view (layers, blocks, ...) of block-major memory: dense, accepted.
    cross = torch.zeros(8, 4, 16, 32).permute(1, 0, 2, 3)
    assert CudaIpcRef.from_tensors([FakeCudaTensor(cross, 0x2000_0100, 1)]).sizes == (cross.numel() * 4,)


def test_from_tensors_refuses_gaps_and_mixed_devices(fake: FakeDriver) -> None:
    sliced = torch.zeros(8, 16, 64)[:, :8]
    with pytest.raises(MemoryRegistrationError, match=r"tensor 0 is not dense .*not a slice"):
        CudaIpcRef.from_tensors([FakeCudaTensor(sliced, 0x1000_0000)])
    with pytest.raises(MemoryRegistrationError, match=r"devices \[0, 1\]"):
        CudaIpcRef.from_tensors([FakeCudaTensor(torch.zeros(4), 0x1000_0000, 0),
                                 FakeCudaTensor(torch.zeros(4), 0x1000_0000, 1)])  # fmt: skip


def test_from_tensors_without_driver_says_so(no_driver: None) -> None:
    with pytest.raises(CudaUnavailableError, match="no CUDA driver in this process"):
        CudaIpcRef.from_tensors([FakeCudaTensor(torch.zeros(4), 0x1000_0000)])


def test_proto_round_trip() -> None:
    r = ref(device=3, device_uuid=UUIDS[1])
    assert memory_from_proto(memory_to_proto(r), "memory") == r
    old = memory_to_proto(ref(sizes=()))  # a worker that sends no sizes
    assert memory_from_proto(old, "memory").sizes == ()


# ---------------------------------------------------------------------------- sidecar side
def test_attach_maps_each_allocation_once_and_closes_it(fake: FakeDriver) -> None:
    a = attach(ref(), LAY)
    assert a.mem_type == "VRAM"
    assert a.table.base.tolist() == [0x1000_0000 + i * LAY.region_bytes for i in range(LAY.num_regions)]
    assert a.table.device.tolist() == [0] * LAY.num_regions
    assert fake.opened == [(0, handle(1))]  # four regions, one allocation, one mapping
    b = attach(ref(), LAY)  # re-registration while the old one is alive: no second open
    assert fake.opened == [(0, handle(1))]
    a.close()
    assert fake.closed == []
    b.close()
    b.close()  # idempotent
    assert fake.closed == [(0, 0x1000_0000)]
    assert len(cuda_ipc.mappings) == 0


def test_attach_finds_the_gpu_by_uuid(fake: FakeDriver) -> None:
    a = attach(ref(device=0, device_uuid=UUIDS[1].upper()), LAY)
    assert a.table.device.tolist() == [1] * LAY.num_regions
    assert fake.opened == [(1, handle(1))]
    a.close()
    with pytest.raises(CudaUnavailableError, match=r"memory.cuda_ipc.device_uuid: the worker's GPU GPU-x .*GPU-0") as e:
        attach(ref(device_uuid="GPU-x"), LAY)
    assert e.value.status == "FAILED_PRECONDITION"
    with pytest.raises(CudaUnavailableError, match=r"memory.cuda_ipc.device: device 5 is not visible"):
        attach(ref(device=5), LAY)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"handles": (handle(1),)}, r"memory.cuda_ipc.handles: the layout has 4 regions \(one per layer\), got 1"),
        ({"offsets": (0, 0)}, r"memory.cuda_ipc.offsets: 2 given for 4 handles"),
        ({"sizes": (1,)}, r"memory.cuda_ipc.sizes: 1 given for 4 handles"),
        ({"handles": (b"short",) * 4}, r"memory.cuda_ipc.handles\[0\]: 5 bytes; a CUDA IPC handle has 64"),
        ({"sizes": (LAY.region_bytes, 100, 0, 0)}, r"memory.cuda_ipc.sizes\[1\]: the tensor has 100 bytes"),
        ({"device": -1}, r"memory.cuda_ipc.device: -1 is negative"),
    ],
)
def test_attach_refuses_bad_refs_before_touching_cuda(fake: FakeDriver, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(MemoryRegistrationError, match=message) as e:
        attach(ref(**kw), LAY)
    assert e.value.status == "INVALID_ARGUMENT"
    assert fake.opened == []


def test_attach_cleans_up_when_a_later_region_fails(fake: FakeDriver) -> None:
    handles = (handle(1), handle(2), handle(3), handle(4))
    fake.fail_open = {handle(3)}
    with pytest.raises(CudaIpcError, match=r"memory.cuda_ipc.handles\[2\]: cannot open .*CUDA_ERROR_INVALID_VALUE"):
        attach(ref(handles=handles), LAY)
    assert sorted(fake.closed) == [(0, 0x1000_0000), (0, 0x2000_0000)]
    fake.fail_open = set()
    fake.alloc_bytes = 2 * LAY.region_bytes
    with pytest.raises(MemoryRegistrationError, match=r"offsets\[2\]: a region of \d+ bytes at offset \d+ overruns"):
        attach(ref(), LAY)
    assert len(cuda_ipc.mappings) == 0


def test_attach_without_driver_names_the_field(no_driver: None) -> None:
    with pytest.raises(CudaUnavailableError) as e:
        attach(ref(), LAY, field="groups[0].memory")
    assert e.value.status == "FAILED_PRECONDITION"
    assert e.value.field == "groups[0].memory.cuda_ipc"
    assert "groups[0].memory.cuda_ipc: this sidecar cannot open CUDA IPC handles: no CUDA driver" in e.value.message


async def test_sidecar_answers_failed_precondition_without_cuda(harness: Harness, no_driver: None) -> None:
    sc = await harness.sidecar(role="decode")
    w = await harness.worker(sc, {"kv": LAY}, register=False)
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION, w.client.register_caches({"kv": (LAY, ref())}),
        "groups[0].memory.cuda_ipc: this sidecar cannot open CUDA IPC handles", "no CUDA driver",
    )  # fmt: skip
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, w.client.register_caches({"kv": (LAY, ref(handles=(b"x",) * 4))}),
        "groups[0].memory.cuda_ipc.handles[0]: 1 bytes",
    )  # fmt: skip
    await w.register()  # shared memory still registers
    assert (await w.client.status())["registered"]


# ---------------------------------------------------------------------------- UCX settings
def test_ucx_engine_config_respects_the_users_env() -> None:
    assert ucx_engine_config({}) == ",".join(f"{k}={v}" for k, v in UCX_DEFAULTS.items())
    assert "CUDA_IPC_ENABLE_GET_ZCOPY=y" in ucx_engine_config({})
    mine = ucx_engine_config({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"})
    assert "GET_ZCOPY" not in mine
    assert "CUDA_IPC_ENABLE_SAME_PROCESS=y" in mine
    assert ucx_engine_config({f"UCX_{k}": "n" for k in UCX_DEFAULTS}) == ""


# ---------------------------------------------------------------------------- the synthetic GPU worker
@pytest.mark.parametrize("cross_layer", [False, True])
def test_cuda_kv_buffer_pages_round_trip_on_cpu(cross_layer: bool) -> None:
    from kvxfer.harness.worker_sim import CudaKVBuffer, fill_blocks, poison_blocks, verify_blocks
    from kvxfer.topology import RankInfo

    lay = attention(layers=3, blocks=10, cross_layer=cross_layer)
    buf = CudaKVBuffer(lay, "cpu", pad=4096)
    assert [r.numel() for r in buf.regions] == [lay.region_bytes] * lay.num_regions
    rank = RankInfo(0, 1)
    fill_blocks(buf, rank, [7, 2, 3], salt=5)
    assert verify_blocks(buf, rank, [7, 2, 3], salt=5) == (3 * lay.page_bytes * 3, 0)
    poison_blocks(buf, [2])
    _, bad = verify_blocks(buf, rank, [7, 2, 3], salt=5)
    assert 0 < bad <= lay.page_bytes * lay.num_layers  # only block 2 of the request was hit


# ---------------------------------------------------------------------------- the ctypes layer itself
class FakeLibCuda:
    """A libcuda.so.1 made of ctypes callbacks: checks what CudaDriver marshals, byte for byte."""

    HANDLE = bytes([0, 1, 0, 2]) * 16  # NULs inside: a handle is raw bytes, not a C string

    def __init__(self, init_rc: int = 0, batch_rc: int = 0) -> None:
        import ctypes as c

        self.batches: list[tuple[list[int], list[int], list[int], int]] = []
        self.single: list[tuple[int, int, int]] = []
        self.queries = 0
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.ctx_depth = 0
        self._keep: list[Any] = []
        h_ptr, u_ptr = c.POINTER(cuda_driver._Handle), c.POINTER(cuda_driver._Uuid)
        i32 = c.c_int
        names = {0: b"CUDA_SUCCESS", 1: b"CUDA_ERROR_INVALID_VALUE", 101: b"CUDA_ERROR_INVALID_DEVICE"}

        def cb(restype: Any, *argtypes: Any) -> Any:
            return lambda fn: self._keep.append(c.CFUNCTYPE(restype, *argtypes)(fn)) or self._keep[-1]

        def set_int(p: Any, v: int) -> None:
            p[0] = v

        def retain(p: Any, dev: int) -> int:
            p[0] = 0x1000 + dev
            return 0

        def push(_ctx: Any) -> int:
            self.ctx_depth += 1
            return 0

        def pop(_p: Any) -> int:
            self.ctx_depth -= 1
            return 0

        self.current = 0  # the thread's current context, as cuCtxGetCurrent / cuCtxSetCurrent see it
        self.made_current: list[int] = []

        def get_current(p: Any) -> int:
            p[0] = self.current or None
            return 0

        def set_current(ctx: Any) -> int:
            self.current = ctx or 0
            self.made_current.append(self.current)
            return 0

        def address_range(pb: Any, ps: Any, ptr: int) -> int:
            assert self.ctx_depth == 1, "called without a current context"
            pb[0], ps[0] = ptr & ~0xFFFFFF, 0x1000000
            return 0

        def get_handle(ph: Any, base: int) -> int:
            c.memmove(ph, self.HANDLE, 64)
            return 0 if base & 0xFFFFFF == 0 else 1

        def open_handle(pptr: Any, h: Any, flags: int) -> int:
            self.opened.append(bytes(h.reserved))
            pptr[0] = 0x7000_0000
            return 0

        def close_handle(ptr: int) -> int:
            self.closed.append(ptr)
            return 0

        def pointer_attr(p: Any, attr: int, ptr: int) -> int:
            c.cast(p, c.POINTER(c.c_int))[0] = 1
            return 0

        def error_name(rc: int, p: Any) -> int:
            p[0] = names.get(rc, b"CUDA_ERROR_UNKNOWN")
            return 0

        def error_string(rc: int, p: Any) -> int:
            p[0] = b"invalid argument" if rc == 1 else None
            return 0

        def uuid(p: Any, dev: int) -> int:
            c.memmove(p, bytes(range(16)), 16)
            return 0

        self.cuInit = cb(i32, c.c_uint)(lambda flags: init_rc)
        self.cuDeviceGetCount = cb(i32, c.POINTER(i32))(lambda p: set_int(p, 2) or 0)
        self.cuDeviceGet = cb(i32, c.POINTER(i32), i32)(lambda p, o: 101 if o >= 2 else set_int(p, o) or 0)
        self.cuDevicePrimaryCtxRetain = cb(i32, c.POINTER(c.c_void_p), i32)(retain)
        self.cuCtxPushCurrent_v2 = cb(i32, c.c_void_p)(push)
        self.cuCtxPopCurrent_v2 = cb(i32, c.POINTER(c.c_void_p))(pop)
        self.cuCtxGetCurrent = cb(i32, c.POINTER(c.c_void_p))(get_current)
        self.cuCtxSetCurrent = cb(i32, c.c_void_p)(set_current)
        self.cuMemGetAddressRange_v2 = cb(i32, c.POINTER(c.c_uint64), c.POINTER(c.c_size_t), c.c_uint64)(address_range)
        self.cuIpcGetMemHandle = cb(i32, h_ptr, c.c_uint64)(get_handle)
        self.cuIpcOpenMemHandle_v2 = cb(i32, c.POINTER(c.c_uint64), cuda_driver._Handle, c.c_uint)(open_handle)
        self.cuIpcCloseMemHandle = cb(i32, c.c_uint64)(close_handle)
        self.cuPointerGetAttribute = cb(i32, c.c_void_p, i32, c.c_uint64)(pointer_attr)
        self.cuGetErrorName = cb(i32, i32, c.POINTER(c.c_char_p))(error_name)
        self.cuGetErrorString = cb(i32, i32, c.POINTER(c.c_char_p))(error_string)
        self.cuDeviceGetUuid_v2 = cb(i32, u_ptr, i32)(uuid)

        u64p, szp = c.POINTER(c.c_uint64), c.POINTER(c.c_size_t)

        def batch(d: Any, s: Any, z: Any, n: int, attrs: Any, idx: Any, nattrs: int, stream: Any) -> int:
            assert (nattrs, idx[0], stream) == (1, 0, 0x5)
            self.batches.append(([d[i] for i in range(n)], [s[i] for i in range(n)], [z[i] for i in range(n)],
                                 attrs[0].srcAccessOrder))  # fmt: skip
            return batch_rc

        def single(d: int, s: int, z: int, stream: Any) -> int:
            self.single.append((d, s, z))
            return 0

        def query(ev: Any) -> int:
            if ev != 0xE1:
                return 400  # CUDA_ERROR_INVALID_HANDLE
            self.queries += 1
            return 600 if self.queries == 1 else 0  # not ready, then done

        def out_ptr(v: int) -> Any:
            def fn(p: Any, flags: int) -> int:
                p[0] = v
                return 0

            return fn

        self.cuStreamCreate = cb(i32, c.POINTER(c.c_void_p), c.c_uint)(out_ptr(0x5))
        self.cuEventCreate = cb(i32, c.POINTER(c.c_void_p), c.c_uint)(out_ptr(0xE1))
        self.cuEventRecord = cb(i32, c.c_void_p, c.c_void_p)(lambda ev, st: 0)
        self.cuEventQuery = cb(i32, c.c_void_p)(query)
        self.cuEventDestroy_v2 = cb(i32, c.c_void_p)(lambda ev: 0)
        self.synced: list[int] = []

        def synchronize(ev: Any) -> int:
            self.synced.append(ev)
            return 0 if ev == 0xE1 else 400

        self.cuEventSynchronize = cb(i32, c.c_void_p)(synchronize)
        self.cuMemcpyDtoDAsync_v2 = cb(i32, c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p)(single)
        self.cuMemcpyBatchAsync_v2 = cb(
            i32, u64p, u64p, szp, c.c_size_t, c.POINTER(cuda_driver._MemcpyAttributes), szp, c.c_size_t, c.c_void_p
        )(batch)


def test_driver_marshals_handles_with_nul_bytes_and_offsets() -> None:
    lib = FakeLibCuda()
    drv = cuda_ipc.CudaDriver(lib)  # type: ignore[arg-type]
    assert drv.device_count() == 2
    assert drv.device_uuid(1) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    exp = drv.export(0, 0x3000_1000)
    assert exp == Exported(FakeLibCuda.HANDLE, 0x1000, 0x1000000)
    assert drv.open(1, exp.handle) == 0x7000_0000
    assert lib.opened == [FakeLibCuda.HANDLE]
    drv.close(1, 0x7000_0000)
    assert lib.closed == [0x7000_0000]
    assert lib.ctx_depth == 0  # every push popped
    with pytest.raises(CudaIpcError, match=r"cuDeviceGet\(7\): CUDA_ERROR_INVALID_DEVICE"):
        drv.device_uuid(7)
    assert drv.error_text(1) == "CUDA_ERROR_INVALID_VALUE (invalid argument)"


@pytest.mark.parametrize(("rc", "message"), [(100, "no CUDA device is visible"), (3, "did not initialize")])
def test_driver_init_failures(rc: int, message: str) -> None:
    with pytest.raises(CudaUnavailableError, match=message):
        cuda_ipc.CudaDriver(FakeLibCuda(init_rc=rc))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- same-host READ shortcut
class InnerPlane(Transport):
    """A backend that records what reaches it."""

    name = "fake"

    def __init__(self, name: str, gather: CudaGather = "kernel") -> None:
        super().__init__("inner", TransportConfig(cuda_gather=gather))
        self.who = name
        self.reads: list[str] = []

    def register(self, table: Any, mem_type: MemType = "DRAM") -> Registration:
        return Registration(table, mem_type, ("reg", mem_type))

    def deregister(self, registration: Registration) -> None:
        assert registration.handle[0] == "reg"

    def metadata(self) -> bytes:
        return f"backend-metadata-of-{self.who}".encode()

    def add_peer(self, metadata: bytes) -> str:
        assert metadata.startswith(b"backend-metadata-of-"), metadata[:40]
        return metadata.decode().rsplit("-", 1)[1]

    def remove_peer(self, peer: str) -> None:
        pass

    async def transfer(self, op: Op, local: Any, remote: Any, peer: str, **kw: Any) -> TransferResult:
        self.reads.append(f"{peer}:{kw['mem_type']}")
        return TransferResult(0, 0, 0.0)

    def poll_notifications(self) -> list[Notification]:
        return []

    def close(self) -> None:
        pass


def _planes(fake: FakeDriver, gather: CudaGather = "kernel") -> tuple[Any, Any, Any]:
    """A publisher (worker allocation handle(1) at offset 0x1000 in it) and a reader on this host."""
    pub, rd = CudaIpcDirect(InnerPlane("pub")), CudaIpcDirect(InnerPlane("rd", gather))
    rd._pid = -1  # the two "processes" are this one
    a = attach(ref(offsets=tuple(0x1000 + i * LAY.region_bytes for i in range(4))), LAY)
    reg = pub.register(a.table, "VRAM")
    return pub, rd, (a, reg)


async def test_same_host_reader_copies_from_the_publishers_worker_memory(fake: FakeDriver) -> None:
    import numpy as np

    pub, rd, (a, reg) = _planes(fake)
    md = pub.metadata()
    assert md.startswith(b"KVXFER-CUDA-IPC/1")
    assert md.endswith(b"backend-metadata-of-pub")
    assert rd.add_peer(md) == "pub"
    base = int(a.table.base[1])  # the publisher sidecar's address of region 1
    remote = np.array([[base + 64, 4096, 0], [base + 8192, 128, 0]], dtype=np.uint64)
    local = np.array([[0x5000_0000, 4096, 1], [0x5000_2000, 128, 1]], dtype=np.uint64)
    fake.opened.clear()
    await rd.read("pub", local, remote, mem_type="VRAM", remote_mem_type="VRAM", timeout=5.0)
    assert rd.direct_reads == 1
    assert rd._inner.reads == []
    # The reader mapped the worker's allocation on its own GPU (1) and read at the same offsets.
    assert fake.opened == [(1, handle(1))]
    region1 = 0x1000_0000 + 0x1000 + LAY.region_bytes
    assert fake.copies == [(1, [0x5000_0000, 0x5000_2000], [region1 + 64, region1 + 8192], [4096, 128])]
    assert (fake.kernel_flags, rd.kernel_reads) == ([True], 1)  # --cuda-gather kernel, the default
    # DRAM, or a descriptor outside the peer's regions, never take the shortcut.
    await rd.read("pub", local, remote, mem_type="DRAM", remote_mem_type="DRAM", timeout=5.0)
    assert rd._inner.reads == ["pub:DRAM"]
    with pytest.raises(KvxferError, match="outside the peer's registered regions"):
        await rd.read("pub", local, remote + np.array([[1 << 40, 0, 0]], dtype=np.uint64), mem_type="VRAM",
                      remote_mem_type="VRAM", timeout=5.0)  # fmt: skip
    rd.remove_peer("pub")
    assert (1, 0x1000_0000) in fake.closed  # the reader's mapping is gone with the peer
    pub.deregister(reg)
    assert pub.metadata() == b"backend-metadata-of-pub"
    a.close()


def test_a_same_host_read_as_the_publishing_workers_allocations_and_offsets(fake: FakeDriver) -> None:
    import numpy as np

    pub, rd, (a, _reg) = _planes(fake)
    rd.add_peer(pub.metadata())
    base0, base3 = int(a.table.base[0]), int(a.table.base[3])
    remote = np.array([[base3 + 100, 28, 0], [base0, 4096, 0]], dtype=np.uint64)
    local = np.array([[0x5000_0000, 28, 1], [0x5000_1000, 4096, 1]], dtype=np.uint64)
    fake.opened.clear()
    g = rd.same_host_gather("pub", local, remote, mem_type="VRAM", remote_mem_type="VRAM")
    assert g is not None
    assert g.handles == handle(1) * 4
    assert g.device_uuids == (UUIDS[0],) * 4
    # Region r sits at 0x1000 + r * region_bytes in the worker's allocation (see _planes).
    assert g.source.tolist() == [3, 0]
    assert g.offset.tolist() == [0x1000 + 3 * LAY.region_bytes + 100, 0x1000]
    assert fake.opened == []
    assert fake.copies == []
    assert rd.same_host_gather("pub", local, remote, mem_type="DRAM", remote_mem_type="DRAM") is None
    assert rd.same_host_gather("other", local, remote, mem_type="VRAM", remote_mem_type="VRAM") is None
    with pytest.raises(KvxferError, match="outside the peer's registered regions"):
        rd.same_host_gather("pub", local, remote + np.array([[1 << 40, 0, 0]], dtype=np.uint64), mem_type="VRAM",
                            remote_mem_type="VRAM")  # fmt: skip
    a.close()


async def test_the_event_loop_sees_a_read_end_and_a_thread_waits_only_for_a_long_one(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from kvxfer.transport import cuda_ipc_direct

    pub, rd, (a, _reg) = _planes(fake)
    rd.add_peer(pub.metadata())
    desc = np.array([[int(a.table.base[0]), 64, 1]], dtype=np.uint64)
    fake.not_ready = 3
    await rd.read("pub", desc, desc, mem_type="VRAM", remote_mem_type="VRAM", timeout=5.0)
    assert (fake.polls, fake.waits, rd._waiter) == (4, [], None)  # polled once per loop turn, no thread
    # Past the polling window (here: none) a thread sleeps in the driver until the copies end.
    monkeypatch.setattr(cuda_ipc_direct, "SPIN_S", 0.0)
    fake.polls, fake.not_ready = 0, 10**9
    await rd.read("pub", desc, desc, mem_type="VRAM", remote_mem_type="VRAM", timeout=5.0)
    assert (fake.polls, fake.waits) == (1, [2])
    assert rd.direct_reads == 2
    # Out of time: a READ gives up at once; a WRITE (push) returns only once its copies ended,
    # since queued device copies cannot be recalled.
    monkeypatch.setattr(cuda_ipc_direct, "SPIN_S", 60.0)
    for op in ("READ", "WRITE"):
        fake.polls, fake.not_ready = 0, 5000
        with pytest.raises(KvxferError, match="did not finish within"):
            await rd.transfer(op, desc, desc, "pub", timeout=0.001, mem_type="VRAM", remote_mem_type="VRAM")
        assert (fake.polls > 5000) == (op == "WRITE"), (op, fake.polls)
    rd.close()
    a.close()


async def test_copy_engine_gather_is_chosen_by_config(fake: FakeDriver, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import numpy as np

    pub, rd, (a, _reg) = _planes(fake, "copy-engine")
    rd.add_peer(pub.metadata())
    base = int(a.table.base[0])
    desc = np.array([[base, 64, 1]], dtype=np.uint64)
    with caplog.at_level(logging.DEBUG, logger="kvxfer.transport.cuda_ipc_direct"):
        await rd.read("pub", desc, desc, mem_type="VRAM", remote_mem_type="VRAM", timeout=5.0)
    assert (fake.kernel_flags, rd.direct_reads, rd.kernel_reads) == ([False], 1, 0)
    (phases,) = [r for r in caplog.records if r.getMessage() == "same-host READ phases"]
    assert (phases.spans, phases.how) == (1, "copy-engine")  # type: ignore[attr-defined]
    assert min(phases.translate_us, phases.submit_us, phases.gpu_us, phases.wake_us) >= 0  # type: ignore[attr-defined]
    assert phases.polls == 1  # type: ignore[attr-defined]  # the fake's copies are done at the first poll
    a.close()


async def test_same_host_shortcut_falls_back_when_the_handle_will_not_open(fake: FakeDriver) -> None:
    import numpy as np

    pub, rd, (a, _reg) = _planes(fake)
    md = pub.metadata()
    base = int(a.table.base[0])
    a.close()  # as if the publisher were another process: nothing of it is mapped here
    rd.add_peer(md)
    # Our GPU (1) cannot map it, the worker's own GPU (0, found by UUID) can: copies run there.
    fake.fail_devices = {1}
    desc = np.array([[base, 64, 1]], dtype=np.uint64)
    await rd.read("pub", desc, np.array([[base, 64, 0]], dtype=np.uint64), mem_type="VRAM", remote_mem_type="VRAM",
                  timeout=5.0)  # fmt: skip
    assert rd.direct_reads == 1
    assert fake.opened[-1] == (0, handle(1))
    rd.remove_peer("pub")
    # Neither GPU can: the backend moves the bytes, for this and later READs.
    rd.add_peer(md)
    fake.fail_devices = {0, 1}
    for _ in range(2):
        await rd.read("pub", desc, desc, mem_type="VRAM", remote_mem_type="VRAM", timeout=5.0)
    assert rd._inner.reads == ["pub:VRAM", "pub:VRAM"]
    assert "CUDA_ERROR_INVALID_VALUE" in rd._peers["pub"].broken
    assert len(cuda_ipc.mappings) == 0


def test_other_hosts_and_disabled_readers_use_the_backend(fake: FakeDriver) -> None:
    pub, rd, (a, _reg) = _planes(fake)
    md = pub.metadata()
    rd._host = "another-host"
    rd.add_peer(md)
    assert "pub" not in rd._peers
    off = CudaIpcDirect(InnerPlane("off"), enabled=False)
    assert off.add_peer(md) == "pub"  # the envelope is stripped even when the shortcut is off
    assert off._peers == {}
    a.close()


@pytest.mark.parametrize("batch_rc", [0, 1])
def test_driver_copies_in_one_batch_or_one_call_each(batch_rc: int) -> None:
    import numpy as np

    lib = FakeLibCuda(batch_rc=batch_rc)
    drv = cuda_ipc.CudaDriver(lib)  # type: ignore[arg-type]
    dst = np.array([0x1000, 0x2000, 0x3000], dtype=np.uint64)
    src = np.array([0x9000, 0xA000, 0xB000], dtype=np.uint64)
    sizes = np.array([16, 32, 48], dtype=np.uint64)
    b = drv.copy_async(0, dst, src, sizes)
    assert lib.batches == [([0x1000, 0x2000, 0x3000], [0x9000, 0xA000, 0xB000], [16, 32, 48], 1)]
    if batch_rc == 0:
        assert (b.calls, lib.single, drv.batch_error) == (1, [], "")
    else:  # the driver refused the batch: one copy each, now and later
        assert b.calls == 3
        assert lib.single == [(0x1000, 0x9000, 16), (0x2000, 0xA000, 32), (0x3000, 0xB000, 48)]
        assert drv.batch_error.startswith("cuMemcpyBatchAsync: CUDA_ERROR_INVALID_VALUE")
        assert drv.copy_async(0, dst, src, sizes).calls == 3
    assert drv.done(b) is False
    assert drv.done(b) is True
    drv.wait(drv.copy_async(0, dst, src, sizes))
    with pytest.raises(CudaIpcError, match="device copies"):
        drv.wait(cuda_ipc.CopyBatch(0, 0xBAD, 1))
    assert lib.ctx_depth == 0


def test_ucx_memtype_cache_is_off_unless_the_user_says_otherwise() -> None:
    from kvxfer.transport.nixl_agent import _prepare_ucx_env

    env: dict[str, str] = {}
    _prepare_ucx_env(env)
    assert env == {"UCX_MEMTYPE_CACHE": "n"}
    mine = {"UCX_MEMTYPE_CACHE": "y"}
    _prepare_ucx_env(mine)
    assert mine == {"UCX_MEMTYPE_CACHE": "y"}


def test_driver_wait_sleeps_in_the_driver_and_gives_the_event_back() -> None:
    import numpy as np

    lib = FakeLibCuda()
    drv = cuda_ipc.CudaDriver(lib)  # type: ignore[arg-type]
    one = np.array([0x1000], dtype=np.uint64)
    drv.wait(drv.copy_async(0, one, one, one))
    assert (lib.queries, lib.synced) == (1, [0xE1])  # not ready: it sleeps in cuEventSynchronize
    assert drv._events[0] == [0xE1]  # and the event serves the next batch
    with pytest.raises(CudaIpcError, match="device copies"):
        drv.wait(cuda_ipc.CopyBatch(0, 0xBAD, 1))  # a failed event is reported
    assert lib.ctx_depth == 0


@st.composite
def peer_reads(draw: Any) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """A publisher's exported regions (base, size, offset in its allocation, allocation), gaps between
    them, and descriptors that fall inside one, straddle two, run past the end, or lie before every
    region. Some allocations export two regions at one base (the groups of a block-major cache that
    share an allocation), the later one shorter or longer."""
    regions, at = [], draw(st.integers(0x1000, 1 << 40))
    for alloc in range(draw(st.integers(1, 6))):
        at += draw(st.integers(0, 4096))
        offset = draw(st.integers(0, 1 << 30))
        sizes = draw(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=2))
        regions.extend((at, size, offset, alloc) for size in sizes)
        at += max(sizes)
    descs = []
    for _ in range(draw(st.integers(1, 12))):
        base, size, _off, _alloc = draw(st.sampled_from(regions))
        start = draw(st.integers(base - 8, base + size))
        descs.append((start, draw(st.one_of(st.integers(1, size + 8), st.just((1 << 64) - 1)))))
    return regions, descs


@given(peer_reads())
@settings(max_examples=300, deadline=None)
def test_remote_addresses_translate_as_one_region_at_a_time_would(
    case: tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]],
) -> None:
    import numpy as np

    from kvxfer.topology import RegionIndex
    from kvxfer.transport.cuda_ipc_direct import _Export, _Peer
    from kvxfer.transport.errors import TransferFailedError

    regions, descs = case
    exports = [_Export(b, s, handle(alloc + 1), off, UUIDS[0]) for b, s, off, alloc in regions]
    bases = np.array([e.base for e in exports], dtype=np.uint64)
    peer = _Peer(bases, RegionIndex.of(bases, np.array([e.size for e in exports], dtype=np.uint64)), exports)
    mapped_at = {handle(alloc + 1): 0x7F00_0000_0000 + alloc * (1 << 32) for *_, alloc in regions}
    rd = CudaIpcDirect(InnerPlane("rd"))
    opened: list[bytes] = []
    rd._open = lambda e, ordinal: opened.append(e.handle) or (ordinal, mapped_at[e.handle])  # type: ignore[method-assign]

    want: list[int] = []  # the reference: each descriptor inside some region, where its allocation is mapped here
    touched: set[bytes] = set()
    bad = None
    for k, (addr, size) in enumerate(descs):
        home = [e for e in exports if e.base <= addr and addr + size <= e.base + e.size]
        if not home:
            bad = k
            break
        want.append(mapped_at[home[0].handle] + home[0].offset + addr - home[0].base)
        touched.add(home[0].handle)
    remote = np.array([[a, z, 0] for a, z in descs], dtype=np.uint64)
    if bad is not None:
        with pytest.raises(TransferFailedError, match=rf"remote descriptor {bad} \({descs[bad][0]:#x}, "):
            rd._translate("pub", peer, remote, 0)
        assert opened == []  # nothing is mapped for a READ that is refused
        return
    assert rd._translate("pub", peer, remote, 0).tolist() == want
    assert sorted(opened) == sorted(touched)  # each allocation a READ touches mapped once
    assert rd._translate("pub", peer, remote, 0).tolist() == want
    assert len(opened) == len(touched)  # and not again
    signed = rd._translate("pub", peer, remote.astype(np.int64), 0)  # signed input: the same uint64 addresses
    assert (signed.dtype, signed.tolist()) == (np.uint64, want)
