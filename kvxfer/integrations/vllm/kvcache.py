"""vLLM's KV-cache tensors as kvxfer sees them: a validated layout and memory the sidecar can reach.

``register_kv_caches`` hands the connector one tensor per attention layer, in the standardized
blocks-first layout (``(num_blocks, num_kv_heads, block_size, 2*head_size)``, physically HND or
NHD; quantized ``(num_blocks, 2*num_kv_heads, block_size, head_size)``; MLA
``(num_blocks, block_size, latent)``). All layers must share one shape and dtype: they form one
kvxfer cache group. Per-layer views of one block-major allocation (vLLM's cross-layer layout)
become one cross-layer region.

The sidecar is another process, so the worker's memory must be shareable without a copy:

* **GPU**: CUDA IPC handles of the tensors (:meth:`kvxfer.memory.CudaIpcRef.from_tensors`);
* **CPU**: vLLM allocates its cache with plain ``torch.zeros``, which no other process can map. The
  connector moves each layer's tensor, in place, onto a POSIX shared-memory segment laid out in the
  same standardized layout (:func:`share_on_cpu`): the tensor objects that vLLM's attention layers
  hold keep their identity, shape and strides, only their storage changes (``Tensor.set_``), so
  the model reads and writes the shared pages directly and transfers need no staging copy. The
  old storage is freed once nothing else refers to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvxfer.errors import KvxferError, LayoutError
from kvxfer.layout import CacheKind, KVCacheLayout
from kvxfer.memory import CudaIpcRef, MemoryRef, SharedKVBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["KVCacheDescription", "SharedCaches", "describe_kv_caches", "share_kv_caches"]


class KVCacheDescriptionError(KvxferError):
    """vLLM's caches are not something kvxfer can move; the message says which layer and why."""

    status = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class KVCacheDescription:
    """The cache group of one worker rank: its layout and the tensor of each region."""

    layout: KVCacheLayout
    layer_names: tuple[str, ...]
    #: One tensor per region (each layer's own, or one flat uint8 view for a cross-layer cache).
    regions: tuple[torch.Tensor, ...]
    #: The layer tensors as vLLM gave them, in layer order.
    layers: tuple[torch.Tensor, ...]

    @property
    def is_cuda(self) -> bool:
        """True when the cache lives on a GPU."""
        return bool(self.layers[0].is_cuda)


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], *, total_kv_heads: int) -> KVCacheDescription:
    """Validate vLLM's per-layer caches and describe them as one kvxfer cache group.

    ``total_kv_heads`` is the model's KV-head count (vLLM's ``get_total_num_kv_heads()``); a rank
    holds its share of them. Raises :class:`KVCacheDescriptionError` naming the layer that differs
    or the dimension/stride that is not a standardized layout.
    """
    if not kv_caches:
        raise KVCacheDescriptionError("kv_caches: vLLM registered no KV-cache tensors", field="kv_caches")
    names = tuple(kv_caches)
    layers = tuple(kv_caches[n] for n in names)
    first = layers[0]
    for name, t in zip(names, layers, strict=True):
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or t.device != first.device:
            raise KVCacheDescriptionError(
                f"kv_caches[{name!r}]: shape {tuple(t.shape)} {t.dtype} on {t.device} differs from "
                f"{names[0]!r} ({tuple(first.shape)} {first.dtype} on {first.device}); kvxfer's vLLM connector "
                "moves one uniform group of attention layers (hybrid models are not supported)",
                field="kv_caches",
            )
    kind = _kind_of(first)
    try:
        per_layer = KVCacheLayout.from_tensor(first, kind, total_kv_heads=total_kv_heads)
    except LayoutError as exc:
        if len(layers) > 1 and exc.field == "strides":
            cross = _cross_layer(names, layers, kind, total_kv_heads)
            if cross is not None:
                return cross
        raise KVCacheDescriptionError(f"kv_caches[{names[0]!r}]: {exc.message}", field="kv_caches") from None
    for name, t in zip(names[1:], layers[1:], strict=True):
        if tuple(t.stride()) != tuple(first.stride()):
            raise KVCacheDescriptionError(
                f"kv_caches[{name!r}]: strides {tuple(t.stride())} differ from {names[0]!r} {tuple(first.stride())}",
                field="kv_caches",
            )
    layout = _with_layers(per_layer, len(layers), cross_layer=False)
    return KVCacheDescription(layout, names, layers, layers)


def _kind_of(t: torch.Tensor) -> CacheKind:
    if t.dim() == 3:
        return CacheKind.MLA
    # K/V packed in the content dim keeps the model dtype; quantized caches store K and V heads
    # as separate groups of one-byte codes.
    return CacheKind.QUANTIZED if t.element_size() == 1 else CacheKind.ATTENTION


def _with_layers(layout: KVCacheLayout, num_layers: int, *, cross_layer: bool) -> KVCacheLayout:
    return KVCacheLayout(
        layout.kind, num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size,
        layout.dtype, layout.order, cross_layer, layout.total_kv_heads,
    )  # fmt: skip


def _cross_layer(
    names: Sequence[str], layers: Sequence[torch.Tensor], kind: CacheKind, total_kv_heads: int
) -> KVCacheDescription | None:
    """Per-layer views of one block-major allocation (vLLM's BLHNC): one cross-layer region."""
    import torch

    first = layers[0]
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in layers):
        return None
    page = first[0].numel() * first.element_size()
    if any(t.data_ptr() != first.data_ptr() + i * page for i, t in enumerate(layers)):
        return None
    # The same memory as one (layers, blocks, ...) tensor, stride order (1, 0, 2, ...).
    whole = first.as_strided((len(layers), *first.shape), (first[0].numel(), *first.stride()))
    try:
        layout = KVCacheLayout.from_tensor(whole, kind, total_kv_heads=total_kv_heads)
    except LayoutError:
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=first.device)
    flat.set_(storage, first.storage_offset() * first.element_size(), (layout.region_bytes,), (1,))
    return KVCacheDescription(layout, tuple(names), (flat,), tuple(layers))


@dataclass
class SharedCaches:
    """What the sidecar registers for this worker, and what keeps that memory alive here."""

    description: KVCacheDescription
    memory: MemoryRef
    #: The shared-memory segment on the CPU (None on a GPU); unlinked by :meth:`close`.
    buffer: SharedKVBuffer | None = None

    def close(self) -> None:
        """Remove the segment's name (the mapping stays valid while the tensors use it)."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def share_kv_caches(desc: KVCacheDescription) -> SharedCaches:
    """Make the caches reachable by the sidecar process: CUDA IPC on a GPU, shared memory on a CPU."""
    if desc.is_cuda:
        return SharedCaches(desc, CudaIpcRef.from_tensors(list(desc.regions)))
    buf = share_on_cpu(desc)
    return SharedCaches(desc, buf.ref(), buf)


def share_on_cpu(desc: KVCacheDescription) -> SharedKVBuffer:
    """Move every layer's tensor onto one new shared-memory segment, keeping the tensor objects.

    The current contents are copied first, so this may run at any time; afterwards every
    reference to these tensors (vLLM's attention layers, its model runner) sees the shared pages.
    """
    import torch

    layout = desc.layout
    buf = SharedKVBuffer.create(layout, fill=None)
    storages: list[Any] = []
    try:
        for i, t in enumerate(desc.layers):
            region = buf.regions[layout.region_of_layer(i)]
            storage = torch.from_numpy(region).untyped_storage()
            storages.append(storage)
            offset_bytes = layout.layer_offset(i)
            if offset_bytes % t.element_size():
                raise KVCacheDescriptionError(
                    f"kv_caches[{desc.layer_names[i]!r}]: layer offset {offset_bytes} is not a multiple of the "
                    f"element size {t.element_size()}",
                    field="kv_caches",
                )
            shared = torch.empty(0, dtype=t.dtype)
            shared.set_(storage, offset_bytes // t.element_size(), t.shape, t.stride())
            shared.copy_(t)
            with torch.no_grad():
                t.set_(storage, offset_bytes // t.element_size(), t.shape, t.stride())
            expected = buf.addresses[layout.region_of_layer(i)] + offset_bytes
            if t.data_ptr() != expected:  # pragma: no cover - set_ either works or raises
                raise KVCacheDescriptionError(
                    f"kv_caches[{desc.layer_names[i]!r}]: could not move the tensor onto shared memory",
                    field="kv_caches",
                )
    except BaseException:
        buf.close()
        raise
    return buf
