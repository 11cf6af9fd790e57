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

Reading path: :mod:`.refs` (what a worker sends: one reference type per way, and the errors),
:mod:`.segments` (the worker's shared-memory segment, :class:`SharedKVBuffer`), :mod:`.attach`
(the sidecar maps what a reference names, checked against the layout, as a region table).
"""

from kvxfer.memory.attach import AttachedMemory, attach
from kvxfer.memory.refs import (
    CudaIpcRef,
    FdLookup,
    FdMemoryRef,
    FdRegionRef,
    LibraryRef,
    MemoryRef,
    MemoryRegistrationError,
    SharedMemoryRef,
    ShmRegionRef,
    UnsupportedMemoryError,
    shm_path,
)
from kvxfer.memory.segments import ALIGNMENT, SharedKVBuffer

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
