"""vLLM's own description of its KV caches, turned into kvxfer cache groups.

This is the one module that knows vLLM: its versions, its spec classes
(``vllm/v1/kv_cache_interface.py``), its physical orders (``vllm/v1/kv_cache_layout.py``), how it
splits blocks into kernel blocks and how its CPU kernels arrange K and V inside a page. Every
layout comes from those objects (the KV-cache config, each group's spec, the resolved layout name,
the attention backend), never from a tensor's shape; the views vLLM hands the connector are then
checked against the layout, so a misreading is refused instead of moving wrong bytes. Anything
kvxfer cannot move is refused with a message naming vLLM's field and value.

A vLLM *transfer group* (``KVCacheConfig.transfer_groups``: full attention, sliding window, Mamba,
MLA...) becomes one kvxfer group named ``g<index>`` (``g<index>.<k>`` when its layers need more
than one layout), which both instances of a P/D pair derive the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError, LayoutError, Reason
from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.layout import CacheKind, DType, KVCacheLayout, Order, Packing, head_range

__all__ = [
    "SUPPORTED_VLLM",
    "CacheGroup",
    "KVCacheDescriptionError",
    "TransferGroup",
    "describe_caches",
    "mamba_tp_split",
    "reports_failed_blocks",
    "transfer_groups",
    "vllm_version_supported",
]

#: vLLM releases this connector is tested with (the KV-connector v1 API changes between releases).
SUPPORTED_VLLM = ("0.32", "0.33")


class KVCacheDescriptionError(KvxferError):
    """vLLM's caches are not something kvxfer can move; the message names vLLM's field and value."""

    status = "FAILED_PRECONDITION"
    default_reason = Reason.LAYOUT


def vllm_version_supported(version: str) -> bool:
    """True for the releases in :data:`SUPPORTED_VLLM` (any patch level, any local build tag)."""
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    return major_minor in SUPPORTED_VLLM


# ------------------------------------------------------------------------------ transfer groups
def transfer_groups(kv_cache_config: Any, tp_size: int = 1) -> tuple[TransferGroup, ...]:
    """The transfer groups of an engine, from its ``KVCacheConfig`` (scheduler or worker copy) and TP size."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for i, group in enumerate(_transfer_group_specs(kv_cache_config)):
        spec = _first_spec(group.kv_cache_spec)
        if isinstance(spec, MambaSpec):
            segments, replicated = mamba_tp_split(spec, tp_size)
            out.append(TransferGroup(i, f"g{i}", "state", int(spec.block_size),
                                     spec_blocks=int(spec.num_speculative_blocks),
                                     tp_split=bool(segments) or replicated, segments=segments))  # fmt: skip
        elif isinstance(spec, SlidingWindowSpec):
            out.append(TransferGroup(i, f"g{i}", "window", int(spec.block_size), window=int(spec.sliding_window)))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(TransferGroup(i, f"g{i}", "chunked", int(spec.block_size), chunk=int(spec.attention_chunk_size)))
        else:
            out.append(TransferGroup(i, f"g{i}", "full", int(spec.block_size)))
    return tuple(out)


def mamba_tp_split(spec: Any, tp_size: int) -> tuple[tuple[int, ...], bool]:
    """How a Mamba layer's state is split over ``tp_size`` TP ranks: (segments, replicated).

    ``MambaSpec.tp_replicated``: every rank holds the whole state. Otherwise, with vLLM's DS conv
    state layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: the conv state is (dim, state_len), so each
    sub-projection is contiguous) and a Mamba1, Mamba2 or GDN layer, vLLM's own
    ``derive_mamba_conv_split`` names the conv state's sub-projections (x; x, B, C; Q, K, V), each
    split evenly over the ranks, and the temporal (SSM) state follows, split on its first dim: the
    segments, as this rank's byte sizes in page order, as vLLM's NixlConnector reads them. Anything
    else (the SD layout, other mamba types, states that do not add up): ``((), False)``, an opaque
    page that moves only between equal TP sizes.
    """
    if getattr(spec, "tp_replicated", False):
        return (), True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # a vLLM without NIXL's conv split
        return (), False
    shapes = tuple(getattr(spec, "shapes", ()))
    if not is_conv_state_dim_first() or len(shapes) != 2 or len(shapes[0]) != 2:
        return (), False
    try:
        split = derive_mamba_conv_split(spec, tp_size)
    except (NotImplementedError, AssertionError, ValueError, TypeError, ZeroDivisionError):
        return (), False
    segments = (*(int(b) for b in split.proj_bytes), int(split.ssm_sizes[1]))
    # The conv state's parts and the temporal state are the whole page content, in this order
    # (MambaSpec.shapes order, as the Mamba layer cuts its page); anything else stays opaque.
    if min(segments) < 1 or sum(segments) != int(spec.state_content_size_bytes):
        return (), False
    if sum(segments[:-1]) != int(split.ssm_sizes[0]):
        return (), False
    return segments, False


def reports_failed_blocks(kv_cache_config: Any) -> bool:
    """Whether a failed load may be reported to vLLM as its blocks (``get_block_ids_with_load_errors``).

    vLLM maps failed block ids back to requests only for a model with one KV-cache group (it stops
    the engine otherwise), and then recomputes from the first failed block over the blocks before
    it. That is sound for full attention alone: a sliding window's or a Mamba group's blocks
    before it are null blocks, and the recompute would attend to zeros. Everything else is
    reported per request (``failed_recving``), which recomputes or fails the whole prompt.
    """
    groups = transfer_groups(kv_cache_config)
    return len(kv_cache_config.kv_cache_groups) == 1 and len(groups) == 1 and groups[0].role == "full"


def _transfer_group_specs(kv_cache_config: Any) -> Sequence[Any]:
    groups = getattr(kv_cache_config, "transfer_groups", None)
    return tuple(groups) if groups is not None else tuple(kv_cache_config.kv_cache_groups)


def _first_spec(spec: Any) -> Any:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs wraps one spec per layer
    return next(iter(inner.values())) if inner else spec


# ------------------------------------------------------------------------------ cache groups
@dataclass(frozen=True)
class CacheGroup:
    """One kvxfer cache group of a worker rank: its layout and where each region starts."""

    name: str
    transfer_index: int
    layout: KVCacheLayout
    layer_names: tuple[str, ...]
    #: Address of each region (one per layer, or one for a cross-layer group) in this process.
    region_addresses: tuple[int, ...]


@dataclass(frozen=True)
class _EngineFacts:
    """What the mapping reads from the vLLM config, once."""

    layout_name: str
    cache_dtype: str
    model_dtype: Any
    total_kv_heads: int
    tp_size: int
    tp_rank: int


def describe_caches(
    vllm_config: Any, kv_cache_config: Any, kv_caches: Mapping[str, Any], *, tp_rank: int, tp_size: int
) -> tuple[CacheGroup, ...]:
    """Describe a worker rank's caches as kvxfer groups, from vLLM's config and specs.

    ``kv_caches`` is what ``register_kv_caches`` received. Raises
    :class:`KVCacheDescriptionError` for anything that cannot be moved, naming vLLM's field.
    """
    if not kv_caches:
        raise KVCacheDescriptionError("kv_caches: vLLM registered no KV-cache tensors", field="kv_caches")
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        raise KVCacheDescriptionError(
            f"decode_context_parallel_size: {dcp}; kvxfer moves caches that are not sharded by token position",
            field="decode_context_parallel_size",
        )
    name = getattr(kv_cache_config, "kv_cache_layout", None) or _resolved_layout(vllm_config)
    facts = _EngineFacts(
        layout_name=str(name),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        model_dtype=vllm_config.model_config.dtype,
        total_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    order, cross, heads_outer = _parse_layout_name(facts.layout_name)
    forward = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    out: list[CacheGroup] = []
    for index, group in enumerate(_transfer_group_specs(kv_cache_config)):
        names = [n for n in group.layer_names if n in kv_caches]
        if not names:
            continue
        by_layout: dict[KVCacheLayout, list[str]] = {}
        for layer in names:
            spec = _layer_spec(group.kv_cache_spec, layer)
            base = _layout_of(spec, facts, layer, forward.get(layer))
            tensor = _tensor_of(kv_cache_config, layer)
            num_blocks = (
                int(kv_cache_config.num_blocks_of(tensor)) if tensor is not None else kv_cache_config.num_blocks
            )
            view = kv_caches[layer]
            ratio = _kernel_ratio(view, num_blocks, layer)
            lay = _replace(
                base, f"kv_cache_spec of {layer!r} in vLLM layout {facts.layout_name}", num_blocks=num_blocks,
                order=order, heads_outer=heads_outer, kernel_block_size=base.block_size // ratio if ratio > 1 else 0,
            )  # fmt: skip
            by_layout.setdefault(lay, []).append(layer)
        parts = list(by_layout.items())
        for k, (lay, layers) in enumerate(parts):
            gname = f"g{index}" if len(parts) == 1 else f"g{index}.{k}"
            out.append(_group(gname, index, lay, layers, kv_caches, cross, facts.layout_name))
    if not out:
        raise KVCacheDescriptionError(
            f"kv_caches: none of the {len(kv_caches)} layers vLLM registered belongs to a transfer group "
            "(KVCacheConfig.transfer_groups)",
            field="kv_caches",
        )
    return tuple(out)


def _resolved_layout(vllm_config: Any) -> str:
    try:
        return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except (AttributeError, ValueError) as exc:
        raise KVCacheDescriptionError(f"kv_cache_layout: vLLM has not resolved its KV-cache layout ({exc})",
                                      field="kv_cache_layout") from None  # fmt: skip


_LAYOUT_NAMES = {
    "LBHNC": (Order.HND, False, False),
    "HND": (Order.HND, False, False),
    "LBNHC": (Order.NHD, False, False),
    "NHD": (Order.NHD, False, False),
    "LHBNC": (Order.HND, False, True),
    "BLHNC": (Order.HND, True, False),
    "BLNHC": (Order.NHD, True, False),
    "BHLNC": (Order.HND, True, True),
}


def _parse_layout_name(name: str) -> tuple[Order, bool, bool]:
    key = name.rsplit(".", 1)[-1].upper()
    try:
        return _LAYOUT_NAMES[key]
    except KeyError:
        raise KVCacheDescriptionError(
            f"kv_cache_layout: vLLM layout {name!r} is not one kvxfer knows ({', '.join(_LAYOUT_NAMES)})",
            field="kv_cache_layout",
        ) from None


def _layer_spec(group_spec: Any, layer: str) -> Any:
    inner = getattr(group_spec, "kv_cache_specs", None)
    return inner[layer] if inner else group_spec


def _tensor_of(kv_cache_config: Any, layer: str) -> Any:
    for t in kv_cache_config.kv_cache_tensors:
        if layer in t.layers:
            return t
    return None


def _kernel_ratio(view: Any, num_blocks: int, layer: str) -> int:
    # vLLM views a split cache with one dim-0 entry per kernel block (num_blocks * ratio), or groups
    # them back as (num_blocks, ratio, ...) (vllm.v1.kv_cache_interface.group_kernel_blocks).
    shape = tuple(int(s) for s in view.shape)
    if len(shape) == 5 and shape[0] == num_blocks:
        return shape[1]
    if len(shape) != 4 or shape[0] % num_blocks:
        raise KVCacheDescriptionError(
            f"kv_caches[{layer!r}]: a view of shape {shape} for KVCacheConfig.num_blocks={num_blocks}; expected "
            "(num_blocks x kernel blocks per block, H, N, C)",
            field="kv_caches",
        )
    return shape[0] // num_blocks


def _layout_of(spec: Any, facts: _EngineFacts, layer: str, module: Any) -> KVCacheLayout:
    """The per-layer layout (1 layer, num_blocks 1; the caller fills in the rest) of one spec."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec

    where = f"kv_cache_spec of {layer!r}"
    try:
        if isinstance(spec, MambaSpec):
            content = int(spec.state_content_size_bytes)
            padded = int(spec.page_size_bytes)
            segments, replicated = mamba_tp_split(spec, facts.tp_size)
            return KVCacheLayout.mamba(num_layers=1, num_blocks=1, page_size_bytes=content,
                                       page_stride=padded if padded != content else 0, segments=segments,
                                       replicated=replicated)  # fmt: skip
        if not isinstance(spec, AttentionSpec):
            raise KVCacheDescriptionError(f"{where}: {type(spec).__name__} is not a KV-cache kind kvxfer moves",
                                          field="kv_cache_spec")  # fmt: skip
        _refuse_attention_extras(spec, where)
        if isinstance(spec, MLAAttentionSpec):
            return _mla_layout(spec, where)
        return _attention_layout(spec, facts, where, module)
    except LayoutError as exc:
        raise KVCacheDescriptionError(f"{where}: {exc.message}", field="kv_cache_spec") from None


def _refuse_attention_extras(spec: Any, where: str) -> None:
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        raise KVCacheDescriptionError(
            f"{where}: tokens_per_state={tokens_per_state} (compressed or pooled states) is not moved by kvxfer",
            field="tokens_per_state",
        )


def _dtype_of(spec: Any, facts: _EngineFacts, where: str) -> DType:
    mode = getattr(spec, "kv_quant_mode", None)
    mode_name = getattr(mode, "name", "NONE")
    if mode_name == "NONE":
        return DType.parse(str(spec.dtype))
    if mode_name == "FP8_PER_TENSOR":
        return DType.FP8_E5M2 if "e5m2" in facts.cache_dtype else DType.FP8_E4M3
    if mode_name == "NVFP4":
        return DType.NVFP4
    raise KVCacheDescriptionError(
        f"{where}: kv_quant_mode={mode_name} (--kv-cache-dtype {facts.cache_dtype}) keeps scales kvxfer does not "
        "know how to place; supported: auto, bf16, fp16, fp32, fp8 (e4m3, e5m2), nvfp4",
        field="kv_quant_mode",
    )


def _mla_layout(spec: Any, where: str) -> KVCacheLayout:
    row = int(spec.state_content_size_bytes)
    padded = int(spec.page_size_bytes)
    dtype = DType.parse(str(spec.dtype)) if str(spec.dtype) != "torch.uint8" else DType.INT8
    elem = max(1, dtype.bits // 8)
    if row % elem:
        raise KVCacheDescriptionError(f"{where}: an MLA row of {row} bytes is not whole {dtype} elements",
                                      field="state_content_bytes")  # fmt: skip
    lay = KVCacheLayout.mla(num_layers=1, num_blocks=1, block_size=int(spec.block_size), latent_dim=row // elem,
                            dtype=dtype)  # fmt: skip
    return dataclasses.replace(lay, page_stride=padded) if padded != lay.page_bytes else lay


def _attention_layout(spec: Any, facts: _EngineFacts, where: str, module: Any) -> KVCacheLayout:
    heads, hs, hs_v = int(spec.num_kv_heads), int(spec.head_size), int(spec.head_size_v)
    dtype = _dtype_of(spec, facts, where)
    total = _total_heads(heads, facts, where)
    slots = getattr(spec, "num_head_slots", None)
    content = getattr(spec, "state_content_bytes", None)
    padded = int(spec.page_size_bytes)
    elem = max(1, dtype.bits // 8)
    if dtype is DType.NVFP4:
        backend = _backend_name(module)
        if backend not in NVFP4_FLASHINFER_BACKENDS:
            # Other nvfp4 kernels publish the same spec fields for another arrangement (vLLM 0.33's
            # MiniMax-M3 backend: K and V of a head in adjacent slots, each slot's data then scales):
            # only the backend tells them apart, so anything but FlashInfer's is refused, not guessed.
            raise KVCacheDescriptionError(
                f"{where}: nvfp4 cache of attention backend {backend or '(unknown)'}; kvxfer moves nvfp4 only in the "
                f"arrangement of {', '.join(sorted(NVFP4_FLASHINFER_BACKENDS))} (K heads then V heads, each side's "
                "data rows then its scale rows)",
                field="attn_backend",
            )
        if slots != 2 * heads or hs != hs_v:
            raise KVCacheDescriptionError(
                f"{where}: nvfp4 with num_head_slots={slots} (expected 2 x num_kv_heads={2 * heads}) and "
                f"head_size_v={hs_v} is not the FlashInfer arrangement kvxfer moves",
                field="num_head_slots",
            )
        kind, packing = CacheKind.QUANTIZED, Packing.KV
    elif slots is None and content is None:
        kind, packing = CacheKind.ATTENTION, _packing(module, spec, facts)
    elif slots == 2 and hs == hs_v and content == heads * hs * elem:
        kind, packing = CacheKind.KV_PLANES, Packing.KV
    else:
        raise KVCacheDescriptionError(
            f"{where}: num_head_slots={slots}, state_content_bytes={content} is a packing of K and V kvxfer "
            "does not know (it moves K|V per head and token, a K and a V plane, and nvfp4 head groups)",
            field="num_head_slots",
        )
    lay = KVCacheLayout(
        kind, 1, 1, int(spec.block_size), heads, hs, dtype, total_kv_heads=total,
        head_size_v=hs_v if kind is CacheKind.ATTENTION else 0, packing=packing,
    )  # fmt: skip
    return dataclasses.replace(lay, page_stride=padded) if padded != lay.page_bytes else lay


#: Attention backends whose nvfp4 pages are FlashInfer's (``nvfp4_split_data_scale`` per side).
NVFP4_FLASHINFER_BACKENDS = frozenset({"FLASHINFER"})


def _backend_name(module: Any) -> str:
    backend = getattr(module, "attn_backend", None)
    return str(backend.get_name()) if backend is not None else ""


def _total_heads(heads: int, facts: _EngineFacts, where: str) -> int:
    """The model's KV heads of this group, checked against vLLM's per-rank count (replicas included)."""
    for total in (facts.total_kv_heads, heads * facts.tp_size):
        try:
            h0, h1 = head_range(total, facts.tp_size, facts.tp_rank)
        except LayoutError:
            continue
        if h1 - h0 == heads:
            return total
    raise KVCacheDescriptionError(
        f"{where}: num_kv_heads={heads} on TP rank {facts.tp_rank}/{facts.tp_size} does not follow from the model's "
        f"{facts.total_kv_heads} KV heads",
        field="num_kv_heads",
    )


def _packing(module: Any, spec: Any, facts: _EngineFacts) -> Packing:
    """How the layer's attention kernel arranges K and V in a page (vLLM's CPU kernels differ)."""
    if _backend_name(module) != "CPU_ATTN":
        return Packing.KV
    isa = getattr(module, "isa", None)
    if isa is None:  # set on the layer when its metadata builder is made; the same rule otherwise
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(facts.model_dtype, int(spec.block_size), int(spec.head_size), facts.cache_dtype)
    # vec/vec16 (AVX-512, AVX2): per (block, head), K transposed then V rows; other ISAs (AMX, NEON...)
    # keep an order of their own, which moves only as whole (block, head) pages.
    return Packing.CPU_KT if isa in ("vec", "vec16") else Packing.HEAD_BLOCK


def _group(
    name: str, index: int, lay: KVCacheLayout, layers: list[str], kv_caches: Mapping[str, Any], cross: bool,
    layout_name: str,
) -> CacheGroup:  # fmt: skip
    """One kvxfer group: its layout over all its layers, each view checked against it."""
    views = [kv_caches[n] for n in layers]
    where = f"kv_cache_spec of {layers[0]!r} in vLLM layout {layout_name}"
    if cross:
        # vLLM gives every group of a block-outermost cache the largest group's block (groups overlay
        # one allocation), so a block may be longer than this group's layers: take vLLM's stride.
        block_bytes = int(views[0].stride(0)) * int(views[0].element_size())
        lay = _replace(lay, where, num_layers=len(layers), cross_layer=True, block_bytes=block_bytes)
        first = int(views[0].data_ptr())
        for i, (layer, v) in enumerate(zip(layers, views, strict=True)):
            if int(v.data_ptr()) != first + lay.layer_offset(i):
                raise KVCacheDescriptionError(
                    f"kv_caches[{layer!r}]: starts {int(v.data_ptr()) - first} bytes after the group's first layer; a "
                    f"block-major ({lay.stride_order}) group needs {lay.layer_offset(i)} "
                    "(KVCacheConfig.kv_cache_tensors packs this group's layers in another order)",
                    field="kv_caches",
                )
        addresses: tuple[int, ...] = (first,)
    else:
        lay = _replace(lay, where, num_layers=len(layers))
        addresses = tuple(int(v.data_ptr()) for v in views)
    for layer, v in zip(layers, views, strict=True):
        _check_view(lay, layer, v)
    return CacheGroup(name, index, lay, tuple(layers), addresses)


def _replace(lay: KVCacheLayout, where: str, **changes: Any) -> KVCacheLayout:
    """``lay`` with vLLM's physical layout applied; what kvxfer cannot describe names vLLM's spec."""
    try:
        return dataclasses.replace(lay, **changes)
    except LayoutError as exc:
        raise KVCacheDescriptionError(f"{where}: {exc.message}", field="kv_cache_spec") from None


def _check_view(lay: KVCacheLayout, layer: str, view: Any) -> None:
    """The view vLLM handed over must be exactly the layout's [B, H, N, C] (kernel blocks on dim 0)."""
    elem = int(view.element_size())
    (b, h, n, c), byte_strides = lay.view_geometry()
    want_shape = (b, h, n, c // elem)
    want_strides = (*(st // elem for st in byte_strides[:3]), 1)
    shape = tuple(int(s) for s in view.shape)
    strides = tuple(int(s) for s in view.stride())
    if len(shape) == 5:  # (num_blocks, ratio, H, N, C): compare as 4-D kernel blocks
        shape, strides = (shape[0] * shape[1], *shape[2:]), (strides[1], *strides[2:])
    pairs = zip(shape, strides, want_strides, strict=True)
    if shape != want_shape or any(sz > 1 and got != want for sz, got, want in pairs):
        raise KVCacheDescriptionError(
            f"kv_caches[{layer!r}]: vLLM's view has shape {shape} strides {strides} (elements of {elem} bytes); its "
            f"spec and layout {lay.stride_order} give shape {want_shape} strides {want_strides}",
            field="kv_caches",
        )
