"""Small "engines" made of vLLM's own code: KV-cache specs, configs, allocation and accessors.

Every cache of these tests is laid out by vLLM: the specs are vLLM's spec classes (customized by
vLLM's attention backends where vLLM does that), the ``KVCacheConfig`` comes from vLLM's
``get_kv_cache_config_from_groups`` (which computes each tensor's layer and block strides for the
resolved layout) and the per-layer ``[B, H, N, C]`` views from ``allocate_kv_cache``. Only the
``vllm_config`` is a stand-in carrying the config values those functions and kvxfer read.

Results are read back through the accessors vLLM's backends use (:func:`vllm_parts`): the K|V
cells of the standard layout, the CPU kernels' transposed K, FlashInfer's nvfp4 data and scales
(``_nvfp4_kv_views``), the K and V planes, MLA's squeezed latent rows and the conv/ssm
states a Mamba layer cuts from its page (``MambaBase.bind_kv_cache``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, nvfp4_kv_cache_full_dim, nvfp4_split_data_scale
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VLayout
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved the KV-cache planning out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

from kvxfer.integrations.vllm.spec import CacheGroup, describe_caches
from kvxfer.layout import CacheKind, KVCacheLayout

__all__ = [
    "CPUAttentionBackend",
    "Engine",
    "FlashAttentionBackend",
    "FlashInferName",
    "GroupDef",
    "MambaStub",
    "MiniMaxMsaName",
    "as_row_bytes",
    "attention_spec",
    "build_engine",
    "check_group_against_vllm",
    "default_layers",
    "kvxfer_rows",
    "mamba_spec",
    "mla_spec",
    "nvfp4_spec",
    "storage_bytes",
    "vllm_parts",
    "write_random",
]

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ specs
def attention_spec(
    *, block_size: int, heads: int, head_size: int, cache_dtype: str = "auto",
    model_dtype: torch.dtype = torch.float16, head_size_v: int | None = None, window: int | None = None,
    backend: Any = None, **extra: Any,
) -> AttentionSpec:  # fmt: skip
    """The spec vLLM's ``Attention.get_kv_cache_spec`` builds, customized by ``backend`` as vLLM does."""
    model = SimpleNamespace(dtype=model_dtype)
    common: dict[str, Any] = dict(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, head_size_v=head_size_v,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model), kv_quant_mode=get_kv_quant_mode(cache_dtype), **extra,
    )  # fmt: skip
    spec: AttentionSpec = (
        SlidingWindowSpec(sliding_window=window, **common) if window is not None else FullAttentionSpec(**common)
    )
    return backend.customize_spec(spec) if backend is not None else spec


class FlashInferName:
    """STAND-IN for vLLM's FlashInfer backend class, which cannot be imported on a CPU host (it needs the
    flashinfer package). kvxfer reads only the backend's name from an nvfp4 layer (whose arrangement it
    is); the spec comes from :func:`nvfp4_spec` and the bytes from vLLM's own allocation and accessors."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"


class MiniMaxMsaName:
    """STAND-IN for vLLM 0.33's ``MiniMaxM3SparseMSANvfp4Backend`` (its module needs torchvision): the
    name of an nvfp4 backend that publishes FlashInfer's spec fields for another arrangement."""

    @staticmethod
    def get_name() -> str:
        return "CUTLASS_MSA"


@functools.cache
def nvfp4_kv_views() -> Callable[[torch.Tensor, int], Any]:
    """vLLM's own ``_nvfp4_kv_views`` (FlashInfer's reading of an nvfp4 page, HND or NHD), taken from
    the source of ``vllm/v1/attention/backends/flashinfer.py``: that module imports the flashinfer
    package, which a CPU host does not have, so the function is compiled alone with what it uses."""
    spec = importlib.util.find_spec("vllm.v1.attention.backends.flashinfer")
    assert spec is not None
    assert spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_nvfp4_kv_views")
    namespace: dict[str, Any] = {"torch": torch, "nvfp4_split_data_scale": nvfp4_split_data_scale, "_KVPair": Any}
    exec(compile(ast.Module([fn], []), spec.origin, "exec"), namespace)  # vLLM's own code
    return namespace["_nvfp4_kv_views"]  # type: ignore[no-any-return]


def nvfp4_spec(*, block_size: int, heads: int, head_size: int, window: int | None = None) -> AttentionSpec:
    """An nvfp4 spec as FlashInfer's ``customize_spec`` publishes it (FlashInfer is not importable here).

    K and V as two head groups (``num_head_slots = 2 x heads``) of ``nvfp4_kv_cache_full_dim`` bytes.
    """
    spec = attention_spec(block_size=block_size, heads=heads, head_size=head_size, cache_dtype="nvfp4", window=window)
    assert spec.kv_quant_mode.is_nvfp4
    assert spec.dtype == torch.uint8
    return dataclasses.replace(
        spec, num_head_slots=2 * heads, state_content_bytes=nvfp4_kv_cache_full_dim(head_size) * spec.dtype.itemsize
    )


def mla_spec(
    *, block_size: int, latent: int = 576, cache_dtype: str = "auto", model_dtype: torch.dtype = torch.float16,
    **extra: Any,
) -> MLAAttentionSpec:  # fmt: skip
    """The spec vLLM's ``MLAAttention.get_kv_cache_spec`` builds."""
    return MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=latent,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, SimpleNamespace(dtype=model_dtype)), cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype), **extra,
    )  # fmt: skip


@dataclass
class MambaStub:
    """The two methods of a Mamba layer that ``MambaBase.bind_kv_cache`` calls, and what it binds."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kv_cache: tuple[torch.Tensor, ...] = ()

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    def bind(self, page_view: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The conv/ssm state views vLLM's Mamba layer cuts from its page tensor."""
        MambaBase.bind_kv_cache(self, page_view)  # type: ignore[arg-type]
        return self.kv_cache


def mamba_spec(
    *, shapes: tuple[tuple[int, ...], ...] = ((3, 24), (2, 8, 16)),
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.float32), block_size: int = 64,
    page_size_padded: int | None = None,
) -> MambaSpec:  # fmt: skip
    """A Mamba layer's spec as ``MambaBase.get_kv_cache_spec`` builds it (conv state, ssm state)."""
    return MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes, page_size_padded=page_size_padded)


# ------------------------------------------------------------------------------ engines
@dataclass(frozen=True)
class GroupDef:
    """One KV-cache group: its layers and their spec (as vLLM's KVCacheGroupSpec holds them)."""

    layers: tuple[str, ...]
    spec: KVCacheSpec


@dataclass
class Engine:
    """One worker rank's caches as vLLM lays them out, and the config values kvxfer reads."""

    vllm_config: Any
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]
    layout: VLayout
    tp_rank: int = 0
    tp_size: int = 1
    mamba: dict[str, MambaStub] = field(default_factory=dict)

    def describe(self) -> tuple[CacheGroup, ...]:
        """kvxfer's description of these caches (what the connector registers)."""
        return describe_caches(self.vllm_config, self.kv_cache_config, self.kv_caches, tp_rank=self.tp_rank,
                               tp_size=self.tp_size)  # fmt: skip

    def spec_of(self, layer: str) -> KVCacheSpec:
        return next(g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups if layer in g.layer_names)


def build_engine(
    groups: Sequence[GroupDef], *, layout: VLayout = VLayout.LBHNC, num_blocks: int = 16,
    kernel_block_sizes: Sequence[int] | None = None, backend: Any = CPUAttentionBackend, isa: str | None = "vec",
    cache_dtype: str = "auto", model_dtype: torch.dtype = torch.float16, total_kv_heads: int | None = None,
    tp_rank: int = 0, tp_size: int = 1, dcp: int = 1,
) -> Engine:  # fmt: skip
    """Plan and allocate the caches with vLLM's code for ``layout``, as a worker of this engine would.

    ``backend``/``isa``: what every attention layer of the stand-in forward context says (kvxfer reads
    the CPU kernels' packing from them); Mamba layers get a :class:`MambaStub`.
    """
    heads = [g.spec.num_kv_heads for g in groups if isinstance(g.spec, AttentionSpec)]
    total = total_kv_heads if total_kv_heads is not None else (max(heads) * tp_size if heads else 1)
    modules: dict[str, Any] = {}
    mamba: dict[str, MambaStub] = {}
    for g in groups:
        for name in g.layers:
            if isinstance(g.spec, MambaSpec):
                mamba[name] = MambaStub(tuple(g.spec.shapes), tuple(g.spec.dtypes))
                modules[name] = mamba[name]
            else:
                modules[name] = SimpleNamespace(attn_backend=backend, isa=isa)
    cache_config = SimpleNamespace(
        cache_dtype=cache_dtype, num_gpu_blocks_override=num_blocks, prefix_cache_retention_interval=None,
        get_resolved_kv_cache_layout=lambda: layout,
    )  # fmt: skip
    vllm_config = SimpleNamespace(
        cache_config=cache_config,
        attention_config=SimpleNamespace(hisparse_config=None),
        model_config=SimpleNamespace(dtype=model_dtype, get_total_num_kv_heads=lambda: total),
        compilation_config=SimpleNamespace(static_forward_context=modules),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
    )
    specs = [KVCacheGroupSpec(list(g.layers), g.spec) for g in groups]
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, specs, 0)  # type: ignore[arg-type]
    kv_cache_config.kv_cache_layout = layout.name  # what the engine core hands every worker
    kv_caches = allocate_kv_cache(kv_cache_config, CPU, layout, list(kernel_block_sizes or []) or None)
    for name, stub in mamba.items():
        stub.bind(kv_caches[name])
    for name, t in kv_caches.items():
        if name not in mamba:
            modules[name].kv_cache = t
    return Engine(vllm_config, kv_cache_config, kv_caches, layout, tp_rank, tp_size, mamba)


# ------------------------------------------------------------------------------ reading back
def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (vLLM's backing allocation)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


def vllm_parts(engine: Engine, layer: str) -> dict[str, torch.Tensor]:
    """The parts of every (kernel block, head slot, token) cell as vLLM's kernels read them.

    Each value is a view (no copy) shaped ``(kernel blocks, heads, tokens per kernel block, ...)``
    over the cache memory; the names are kvxfer's plane parts, in kvxfer's plane order.
    """
    view = engine.kv_caches[layer]
    spec = engine.spec_of(layer)
    if isinstance(spec, MambaSpec):
        states = engine.mamba[layer].bind(view)
        return {f"state{i}": s[:, None, None] for i, s in enumerate(states)}
    assert isinstance(spec, AttentionSpec)
    if view.dim() == 5:  # grouped kernel blocks
        view = view.flatten(0, 1)
    bk, slots, n, _ = view.shape
    if isinstance(spec, MLAAttentionSpec):
        return {"latent": view.squeeze(1)[:, None]}  # MLAAttention.bind_kv_cache: [B, 1, N, C] -> [B, N, C]
    heads, d = spec.num_kv_heads, spec.head_size
    if spec.kv_quant_mode.is_nvfp4:
        # FlashInfer: each side's data then scales, its rows in the page's order (HND or NHD).
        (k_data, v_data), (k_scale, v_scale), order = nvfp4_kv_views()(view, heads)
        parts = {"k_data": k_data, "k_scale": k_scale, "v_data": v_data, "v_scale": v_scale}
        return {p: t.transpose(1, 2) if order == "NHD" else t for p, t in parts.items()}
    if spec.num_head_slots == 2:  # a K plane and a V plane, each (N, H, D) per block
        return {p: view[:, i].view(bk, n, heads, d).transpose(1, 2) for i, p in enumerate(("k", "v"))}
    module = engine.vllm_config.compilation_config.static_forward_context[layer]
    if module.attn_backend.get_name() == "CPU_ATTN":
        # CPUAttentionBackendImpl: view (B, H, 2N, D); K of token n is column n of the first N rows
        # read as (D, N), V of token n is row N + n.
        kv = view.view(bk, slots, 2 * n, -1)
        key = kv[:, :, :n].view(bk, slots, d, n).transpose(2, 3)
        return {"k": key, "v": kv[:, :, n:]}
    return {"kv": view}


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_random(parts: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Random bit patterns into every element of vLLM's views (written as integers of the element's size)."""
    for t in parts.values():
        raw = t.view(_SAME_SIZE_INT[t.element_size()])
        noise = torch.randint(0, 256, (*raw.shape, t.element_size()), generator=gen, dtype=torch.uint8)
        raw.copy_(noise.view(raw.dtype).squeeze(-1))


def as_row_bytes(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parts' bytes per (kernel block, head, token), concatenated in part order."""
    rows = []
    for t in parts.values():
        b, h, n = t.shape[:3]
        rows.append(t.view(_SAME_SIZE_INT[t.element_size()]).contiguous().view(torch.uint8).reshape(b, h, n, -1))
    return torch.cat(rows, dim=-1)


def kvxfer_rows(group: CacheGroup, index: int, storage: torch.Tensor) -> torch.Tensor:
    """Layer ``index`` of ``group`` read through kvxfer's planes (``plane_view`` at the region address).

    Shaped like :func:`as_row_bytes`: (kernel blocks, heads, tokens per kernel block, bytes).
    """
    lay = group.layout
    base = group.region_addresses[lay.region_of_layer(index)] - storage.data_ptr()
    rows = []
    for plane in lay.planes:
        off, shape, strides = lay.plane_view(index, plane)
        t = torch.as_strided(storage, shape, strides, base + off)
        rows.append(t.reshape(shape[0] * shape[1], shape[2], shape[3], -1))
    return torch.cat(rows, dim=-1)


def cell_addresses(t: torch.Tensor) -> np.ndarray:
    """Byte addresses of every byte of the elements of view ``t`` (from its data pointer and strides)."""
    e = t.element_size()
    addr = np.full((1,) * t.dim(), t.data_ptr(), dtype=np.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[dim] = size
        addr = addr + (np.arange(size, dtype=np.int64) * stride * e).reshape(shape)
    return (addr[..., None] + np.arange(e, dtype=np.int64)).ravel()


def span_addresses(spans: Sequence[tuple[int, int]], region_address: int) -> np.ndarray:
    """Byte addresses covered by kvxfer's spans (offsets in a region at ``region_address``)."""
    if not spans:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(region_address + o, region_address + o + n, dtype=np.int64) for o, n in spans])


def block_cells(
    parts: dict[str, torch.Tensor], lay: KVCacheLayout, block: int, heads: tuple[int, int], tokens: tuple[int, int]
) -> np.ndarray:
    """vLLM's byte addresses of ``heads`` x ``tokens`` of manager block ``block`` (every part)."""
    nk, r = lay.tokens_per_kernel_block, lay.kernel_blocks_per_block
    out = []
    for t in parts.values():
        for tok in range(*tokens):
            kb, n = block * r + tok // nk, tok % nk
            out.append(cell_addresses(t[kb, heads[0] : heads[1], n]))
    return np.concatenate(out)


def check_group_against_vllm(engine: Engine, group: CacheGroup, *, seed: int = 0) -> int:
    """Every byte kvxfer's layout names for ``group`` is where vLLM's own accessors put it.

    Writes random bytes into every cell through vLLM's accessors, reads them back through kvxfer's
    plane views, then compares kvxfer's spans and row offsets with the addresses of vLLM's cells.
    Returns the number of bytes compared.
    """
    lay = group.layout
    storage = storage_bytes(engine.kv_caches[group.layer_names[0]])
    gen = torch.Generator().manual_seed(seed)
    compared = 0
    for i, name in enumerate(group.layer_names):
        parts = vllm_parts(engine, name)
        if lay.kind is not CacheKind.MAMBA:
            assert [p.part for p in lay.planes] == list(parts), (name, lay.planes)
        write_random(parts, gen)
        want = as_row_bytes(parts)
        got = kvxfer_rows(group, i, storage)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(got, want), f"{name}: kvxfer's planes read other bytes than vLLM's cells"
        compared += got.numel()
        region = group.region_addresses[lay.region_of_layer(i)]
        blocks = sorted({0, lay.num_blocks // 2, lay.num_blocks - 1})
        heads = lay.num_kv_heads if lay.kind not in (CacheKind.MLA, CacheKind.MAMBA) else 1
        ranges = [(0, heads)] + [(h, h + 1) for h in range(heads)] * (heads > 1)
        n = lay.tokens_per_page
        token_ranges = [(0, n)] + ([(1, n - 1), (n // 2, n)] if n > 2 else [])
        for b in blocks:
            for hr in ranges:
                for tr in token_ranges:
                    want_addr = np.sort(block_cells(parts, lay, b, hr, tr))
                    got_addr = np.sort(span_addresses(lay.spans(i, b, heads=hr, tokens=tr), region))
                    assert np.array_equal(got_addr, want_addr), (name, b, hr, tr)
            offs, lens = lay.row_offsets(np.arange(heads), np.arange(n))
            start = region + lay.block_offset(i, b)
            got_rows = np.sort(
                np.concatenate([np.arange(start + o, start + o + m) for o, m in zip(offs, lens, strict=True)])
            )
            assert np.array_equal(got_rows, np.sort(block_cells(parts, lay, b, (0, heads), (0, n)))), (name, b)
    return compared


def default_layers(prefix: str, count: int) -> tuple[str, ...]:
    """vLLM-style layer names (``model.layers.<i>.<prefix>``)."""
    return tuple(f"model.layers.{i}.{prefix}" for i in range(count))
