"""Between protobuf messages and the core's types, with errors that name the field path."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer import topology
from kvxfer.errors import BlockIdError, InvalidArgumentError, KvxferError, LayoutError
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import CudaIpcRef, FdMemoryRef, FdRegionRef, LibraryRef, MemoryRef, SharedMemoryRef, ShmRegionRef
from kvxfer.topology import RankInfo, RegionTable
from kvxfer.transport.base import WorkerAgentInfo
from kvxfer.wire import common_pb2, local_pb2

__all__ = [
    "MAX_ID_LEN",
    "blocks_from_proto",
    "blocks_to_proto",
    "check_id",
    "check_reader_engine_id",
    "ids_array",
    "layout_from_proto",
    "layout_to_proto",
    "memory_from_proto",
    "memory_to_proto",
    "rank_from_proto",
    "rank_to_proto",
    "regions_from_proto",
    "regions_to_proto",
]

I64 = npt.NDArray[np.int64]
MAX_ID_LEN = 512


def check_id(value: str, field: str) -> str:
    """A request or engine id: non-empty, printable, at most MAX_ID_LEN characters."""
    if not value:
        raise InvalidArgumentError(f"{field}: must not be empty", field=field)
    if len(value) > MAX_ID_LEN:
        raise InvalidArgumentError(f"{field}: {len(value)} characters, at most {MAX_ID_LEN} allowed", field=field)
    if not value.isprintable():
        raise InvalidArgumentError(f"{field}: {value!r} contains non-printable characters", field=field)
    return value


def check_reader_engine_id(value: str, field: str) -> str:
    """The engine a publish is meant for (``reader_engine_id``): empty (any engine), or an id no sidecar
    would refuse as its ``--engine-id`` (which has no spaces): a request held for an engine that cannot
    exist is refused rather than held in vain."""
    if not value:
        return ""
    check_id(value, field)
    if any(c.isspace() for c in value):
        raise InvalidArgumentError(f"{field}: {value!r} cannot be an engine id (--engine-id has no spaces)",
                                   field=field)  # fmt: skip
    return value


def layout_from_proto(msg: common_pb2.Layout, field: str) -> KVCacheLayout:
    """Build and validate a layout; errors read ``<field>.<layout field>: ...``."""
    data = {
        "kind": msg.kind,
        "num_layers": int(msg.num_layers),
        "num_blocks": int(msg.num_blocks),
        "block_size": int(msg.block_size),
        "num_kv_heads": int(msg.num_kv_heads),
        "head_size": int(msg.head_size),
        "dtype": msg.dtype,
        "order": msg.order or "HND",
        "cross_layer": bool(msg.cross_layer),
        "total_kv_heads": int(msg.total_kv_heads),
        "head_size_v": int(msg.head_size_v),
        "heads_outer": bool(msg.heads_outer),
        "page_stride": int(msg.page_stride),
        "kernel_block_size": int(msg.kernel_block_size),
        "packing": msg.packing or "kv",
        "block_bytes": int(msg.block_bytes),
        "segments": [int(v) for v in msg.segments],
        "replicated": bool(msg.replicated),
    }
    try:
        return KVCacheLayout.from_dict(data)
    except LayoutError as exc:
        sub = exc.field or "layout"
        raise InvalidArgumentError(f"{field}.{exc.message}", field=f"{field}.{sub}") from None


def layout_to_proto(layout: KVCacheLayout) -> common_pb2.Layout:
    """The wire form of a layout."""
    return common_pb2.Layout(
        kind=layout.kind.value, num_layers=layout.num_layers, num_blocks=layout.num_blocks,
        block_size=layout.block_size, num_kv_heads=layout.num_kv_heads, head_size=layout.head_size,
        dtype=layout.dtype.value, order=layout.order.value, cross_layer=layout.cross_layer,
        total_kv_heads=layout.total_kv_heads, head_size_v=layout.head_size_v, heads_outer=layout.heads_outer,
        page_stride=layout.page_stride, kernel_block_size=layout.kernel_block_size, packing=layout.packing.value,
        block_bytes=layout.block_bytes, segments=layout.segments, replicated=layout.replicated,
    )  # fmt: skip


def rank_from_proto(msg: common_pb2.Rank, field: str) -> RankInfo:
    """A rank; sizes of 0 (unset) read as 1."""
    try:
        return RankInfo(int(msg.tp_rank), int(msg.tp_size) or 1, int(msg.pp_rank), int(msg.pp_size) or 1)
    except KvxferError as exc:
        raise InvalidArgumentError(f"{field}.{exc.message}", field=f"{field}.{exc.field}") from None


def rank_to_proto(rank: RankInfo) -> common_pb2.Rank:
    """The wire form of a rank."""
    return common_pb2.Rank(tp_rank=rank.tp_rank, tp_size=rank.tp_size, pp_rank=rank.pp_rank, pp_size=rank.pp_size)


#: Up to this many ids, np.fromiter reads a repeated field faster than np.asarray (which goes
#: through the sequence protocol with a fixed cost of a few microseconds); past it, slower.
_FROMITER_MAX = 64


def ids_array(values: Sequence[int]) -> I64:
    """A repeated int64 field (block ids) as an int64 array: every pull converts a few of these."""
    n = len(values)
    if n <= _FROMITER_MAX:
        return np.fromiter(values, np.int64, n)
    return np.asarray(values, dtype=np.int64)


def blocks_from_proto(
    lists: Sequence[common_pb2.BlockList], layouts: Mapping[str, KVCacheLayout], field: str
) -> dict[str, I64]:
    """Block ids per cache group: every registered group exactly once, ids unique and in range."""
    out: dict[str, I64] = {}
    for i, bl in enumerate(lists):
        where = f"{field}[{i}]"
        if bl.group not in layouts:
            known = ", ".join(repr(g) for g in layouts) or "none"
            raise InvalidArgumentError(
                f"{where}.group: unknown cache group {bl.group!r}; registered groups: {known}", field=f"{where}.group"
            )
        if bl.group in out:
            raise InvalidArgumentError(f"{where}.group: cache group {bl.group!r} given twice", field=f"{where}.group")
        out[bl.group] = check_block_ids(ids_array(bl.block_ids), layouts[bl.group].num_blocks, f"{field}[{bl.group}]")
    missing = [g for g in layouts if g not in out]
    if missing:
        raise InvalidArgumentError(f"{field}: no block ids for cache group {missing[0]!r}", field=field)
    return out


def check_block_ids(ids: I64, num_blocks: int, field: str) -> I64:
    """Non-empty, in ``[0, num_blocks)``, no repeats (:func:`kvxfer.topology.check_block_ids`), as a
    request field: an InvalidArgumentError naming ``field``, the first bad id and its position."""
    try:
        return topology.check_block_ids(ids, num_blocks, field)
    except BlockIdError as exc:
        raise InvalidArgumentError(exc.message, field=field) from None


def blocks_to_proto(
    blocks: Mapping[str, Iterable[int] | I64], spans: Mapping[str, tuple[int, int]] | None = None
) -> list[common_pb2.BlockList]:
    """BlockList messages, one per group; ``spans`` gives a group's (skip_tokens, num_tokens)."""
    out = []
    for g, ids in blocks.items():
        skip, num = (spans or {}).get(g, (0, 0))
        out.append(common_pb2.BlockList(
            group=g, block_ids=np.asarray(ids, dtype=np.int64).tolist(), skip_tokens=skip, num_tokens=num
        ))  # fmt: skip
    return out


def memory_from_proto(msg: local_pb2.Memory, field: str) -> MemoryRef:
    """The memory reference a worker sent."""
    kind = msg.WhichOneof("kind")
    if kind == "shm":
        return SharedMemoryRef(tuple(ShmRegionRef(r.name, int(r.offset)) for r in msg.shm.regions))
    if kind == "cuda_ipc":
        c = msg.cuda_ipc
        return CudaIpcRef(
            tuple(bytes(h) for h in c.handles), tuple(int(o) for o in c.offsets), int(c.device),
            tuple(int(n) for n in c.sizes), c.device_uuid,
        )  # fmt: skip
    if kind == "library":
        lib = msg.library
        return LibraryRef(
            tuple(int(a) for a in lib.addresses), int(lib.device), lib.memory_type or "DRAM", int(lib.pid)
        )
    if kind == "fd":
        return FdMemoryRef(msg.fd.handle, tuple(FdRegionRef(int(r.index), int(r.offset)) for r in msg.fd.regions))
    raise InvalidArgumentError(f"{field}: no memory given (set shm, cuda_ipc, library or fd)", field=field)


def memory_to_proto(ref: MemoryRef) -> local_pb2.Memory:
    """The wire form of a memory reference."""
    if isinstance(ref, SharedMemoryRef):
        regions = [local_pb2.ShmRegion(name=r.name, offset=r.offset) for r in ref.regions]
        return local_pb2.Memory(shm=local_pb2.SharedMemory(regions=regions))
    if isinstance(ref, CudaIpcRef):
        return local_pb2.Memory(
            cuda_ipc=local_pb2.CudaIpc(
                handles=list(ref.handles), offsets=list(ref.offsets), device=ref.device, sizes=list(ref.sizes),
                device_uuid=ref.device_uuid,
            )
        )  # fmt: skip
    if isinstance(ref, FdMemoryRef):
        fd_regions = [local_pb2.FdRegion(index=r.index, offset=r.offset) for r in ref.regions]
        return local_pb2.Memory(fd=local_pb2.FdMemory(handle=ref.handle, regions=fd_regions))
    return local_pb2.Memory(
        library=local_pb2.LibraryMemory(
            addresses=list(ref.addresses), device=ref.device, memory_type=ref.memory_type, pid=ref.pid
        )
    )


def regions_to_proto(table: RegionTable) -> list[common_pb2.Region]:
    """Region messages of a table."""
    return [
        common_pb2.Region(base=int(b), size=int(s), device=int(d))
        for b, s, d in zip(table.base.tolist(), table.size.tolist(), table.device.tolist(), strict=True)
    ]


def regions_from_proto(regions: Sequence[common_pb2.Region], layout: KVCacheLayout, field: str) -> RegionTable:
    """A remote region table, checked against the remote layout."""
    table = RegionTable(
        np.array([r.base for r in regions], dtype=np.uint64),
        np.array([r.size for r in regions], dtype=np.uint64),
        np.array([r.device for r in regions], dtype=np.uint64),
    )
    try:
        table.check_layout(layout)
    except LayoutError as exc:
        raise InvalidArgumentError(f"{field}: {exc.message}", field=field) from None
    return table


def worker_agent_from_proto(msg: local_pb2.WorkerAgent, field: str = "worker_agent") -> WorkerAgentInfo:
    """Parse and check a ``WorkerAgent`` message (errors name the field at fault)."""
    for name, value in (("backend", msg.backend), ("agent_name", msg.agent_name)):
        if not value:
            raise InvalidArgumentError(f"{field}.{name}: empty", field=f"{field}.{name}")
    if msg.backend == "worker":
        raise InvalidArgumentError(
            f"{field}.backend: 'worker' is the sidecar's side; the worker runs a library backend such as 'nixl'",
            field=f"{field}.backend",
        )
    if not msg.metadata:
        raise InvalidArgumentError(f"{field}.metadata: empty (register memory with the agent first)",
                                   field=f"{field}.metadata")  # fmt: skip
    if msg.pid <= 0:
        raise InvalidArgumentError(f"{field}.pid: {msg.pid} is not a process id", field=f"{field}.pid")
    return WorkerAgentInfo(msg.backend, msg.agent_name, bytes(msg.metadata), int(msg.pid))


def worker_agent_to_proto(info: WorkerAgentInfo) -> local_pb2.WorkerAgent:
    """The wire form of a worker's agent."""
    return local_pb2.WorkerAgent(backend=info.backend, agent_name=info.agent_name, metadata=info.metadata,
                                 pid=info.pid)  # fmt: skip
