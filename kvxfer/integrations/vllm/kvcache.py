"""vLLM's KV-cache memory, made reachable by the sidecar without a copy.

:func:`kvxfer.integrations.vllm.spec.describe_caches` says which regions each cache group has;
this module shares them with the sidecar process:

* **GPU**: CUDA IPC handles of the allocations holding the regions
  (:meth:`kvxfer.memory.CudaIpcRef.from_addresses`);
* **CPU**: vLLM allocates its whole cache as one ``torch.zeros`` buffer and views every layer of
  every group into it, which no other process can map. The buffer's storage moves into shared
  memory *in place* (``UntypedStorage._share_fd_cpu_``): every view - the connector's, the
  attention layers', a Mamba layer's conv and SSM state views - keeps its shape, strides and
  offsets and now reads and writes the shared pages; the file is unlinked at once, so nothing is
  left in ``/dev/shm`` however the process ends. The descriptor goes to the sidecar over the
  descriptor socket next to its local socket (:mod:`kvxfer.fdpass`); the connection stays open
  while the worker lives.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.fdpass import FdLease, fd_socket_path, send_fds
from kvxfer.integrations.vllm.spec import CacheGroup, KVCacheDescriptionError
from kvxfer.memory import CudaIpcRef, FdMemoryRef, FdRegionRef, LibraryRef, MemoryRef

__all__ = ["SharedCaches", "own_caches", "share_caches"]


@dataclass
class _Storage:
    """One CPU storage (backing buffer) holding regions, and its descriptor once shared."""

    storage: Any
    base: int
    nbytes: int
    fd: int = -1


@dataclass
class SharedCaches:
    """What the sidecar registers for this worker, and what keeps that memory reachable."""

    groups: tuple[CacheGroup, ...]
    #: CUDA IPC (GPU) or shared-memory descriptors (CPU), per group name; CPU refs are bound to a lease.
    memory: dict[str, MemoryRef]
    #: CPU: per group, (storage index, offset) of each region.
    fd_regions: dict[str, tuple[FdRegionRef, ...]] = field(default_factory=dict)
    fds: tuple[int, ...] = ()
    lease: FdLease | None = None

    @property
    def is_cuda(self) -> bool:
        """True when the caches live on a GPU (or stay this process's own: no descriptors to pass)."""
        return not self.fds

    @property
    def how(self) -> str:
        """How the sidecar reaches the memory, in words (for the logs)."""
        if any(isinstance(m, LibraryRef) for m in self.memory.values()):
            return "the worker's own agent"
        return "CUDA IPC" if self.is_cuda else "shared memory"

    def refs(self, sidecar_socket: str, *, token: str | None) -> dict[str, MemoryRef]:
        """Memory references for a (new) registration: on a CPU, hands the descriptors over (again).

        Either way this process then holds a lease on the sidecar's descriptor socket (with no
        descriptors on a GPU): when the process exits the sidecar drops the registration
        (``RegisterCaches.worker_lease``).
        """
        if self.lease is not None:
            self.lease.close()
        self.lease = send_fds(fd_socket_path(sidecar_socket), self.fds, token=token)
        if self.is_cuda:
            return self.memory
        handle = self.lease.handle
        return {name: FdMemoryRef(handle, regions) for name, regions in self.fd_regions.items()}

    def close(self) -> None:
        """Let the sidecar forget the descriptors (the worker's own mappings stay)."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None


def share_caches(groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]) -> SharedCaches:
    """Make every group's regions reachable by the sidecar process (see the module docs)."""
    first = kv_caches[groups[0].layer_names[0]]
    if first.is_cuda:
        device = int(first.device.index or 0)
        memory: dict[str, MemoryRef] = {}
        for g in groups:
            sizes = [g.layout.region_bytes] * g.layout.num_regions
            memory[g.name] = CudaIpcRef.from_addresses(device, g.region_addresses, sizes)
        return SharedCaches(tuple(groups), memory)
    storages = _storages(groups, kv_caches)
    regions: dict[str, tuple[FdRegionRef, ...]] = {}
    for g in groups:
        refs = []
        for i, addr in enumerate(g.region_addresses):
            k = _holder(storages, addr, g.layout.region_bytes, f"{g.name} region {i}")
            refs.append(FdRegionRef(k, addr - storages[k].base))
        regions[g.name] = tuple(refs)
    for s in storages:
        # In place: every tensor viewing this storage follows (the data pointer changes, offsets do not).
        s.fd, size = s.storage._share_fd_cpu_()
        if size < s.nbytes:  # pragma: no cover - torch shares the whole storage
            raise KVCacheDescriptionError(f"kv_caches: shared {size} of {s.nbytes} bytes", field="kv_caches")
    return SharedCaches(tuple(groups), {}, regions, tuple(os.dup(s.fd) for s in storages))


def own_caches(groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]) -> SharedCaches:
    """The groups' regions at this process's own addresses, for an agent in this process to register.

    Nothing is shared: the worker's agent moves the bytes (``data_plane: worker``). The sidecar
    still gets a lease on its descriptor socket, so it drops the registration when this process exits.
    """
    first = kv_caches[groups[0].layer_names[0]]
    device, mem = (int(first.device.index or 0), "VRAM") if first.is_cuda else (0, "DRAM")
    memory: dict[str, MemoryRef] = {g.name: LibraryRef(tuple(g.region_addresses), device, mem) for g in groups}
    return SharedCaches(tuple(groups), memory)


def _storages(groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]) -> list[_Storage]:
    seen: dict[int, _Storage] = {}
    for g in groups:
        for name in g.layer_names:
            st = kv_caches[name].untyped_storage()
            seen.setdefault(int(st.data_ptr()), _Storage(st, int(st.data_ptr()), int(st.nbytes())))
    return list(seen.values())


def _holder(storages: Sequence[_Storage], address: int, nbytes: int, what: str) -> int:
    for k, s in enumerate(storages):
        if s.base <= address and address + nbytes <= s.base + s.nbytes:
            return k
    raise KVCacheDescriptionError(
        f"kv_caches: {what} ({nbytes} bytes at {address:#x}) lies in no storage of the registered views",
        field="kv_caches",
    )
