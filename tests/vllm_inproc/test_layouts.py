"""kvxfer's description of vLLM's caches against vLLM's own code (no sidecars).

Every case builds a cache the way a vLLM worker does - specs from vLLM's spec classes and backends,
tensor strides from ``get_kv_cache_config_from_groups`` for the resolved layout, per-layer views
from ``allocate_kv_cache`` - and asks :func:`kvxfer.integrations.vllm.spec.describe_caches` for
its layout. Random bytes are then written into every cell through the accessors vLLM's kernels
use, and read back through kvxfer's plane views; kvxfer's spans and row offsets must name exactly
the addresses of vLLM's cells, block by block, head by head and token by token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout as VLayout

import kvxfer.integrations.vllm as integration
from kvxfer.integrations.vllm import spec as spec_module
from kvxfer.integrations.vllm.spec import KVCacheDescriptionError, vllm_version_supported
from kvxfer.layout import CacheKind, DType, Packing
from tests.vllm_inproc.engine import (
    FlashAttentionBackend,
    FlashInferName,
    GroupDef,
    MiniMaxMsaName,
    attention_spec,
    build_engine,
    check_group_against_vllm,
    default_layers,
    mamba_spec,
    mla_spec,
    nvfp4_spec,
)

L3 = default_layers("self_attn.attn", 3)
L4 = default_layers("self_attn.attn", 4)
ALL = tuple(VLayout)
HND = (VLayout.LBHNC, VLayout.LHBNC, VLayout.BLHNC, VLayout.BHLNC)
PAGE_GRID = (VLayout.LBHNC, VLayout.LBNHC, VLayout.BLHNC, VLayout.BLNHC)  # L and B outside the page
LAYER_OUTER = (VLayout.LBHNC, VLayout.LBNHC)
H, D = 4, 64


@dataclass(frozen=True)
class Case:
    """A cache vLLM can hand over, and the layouts to check it in."""

    groups: Callable[[], list[GroupDef]]
    kw: dict[str, Any] = field(default_factory=dict)
    layouts: tuple[VLayout, ...] = ALL
    #: (kind, dtype, packing) kvxfer must read for each group.
    expect: tuple[tuple[CacheKind, DType, Packing], ...] = ((CacheKind.ATTENTION, DType.FP16, Packing.KV),)
    #: Layouts vLLM allocates but kvxfer gets wrong (strict xfail, with the reason).
    bugs: dict[VLayout, str] = field(default_factory=dict)


def one(spec: Any, layers: tuple[str, ...] = L3) -> Callable[[], list[GroupDef]]:
    return lambda: [GroupDef(layers, spec)]


FA = {"backend": FlashAttentionBackend}
FI = {"backend": FlashInferName}  # nvfp4 layers: FlashInfer's arrangement
ATT = CacheKind.ATTENTION
CASES: dict[str, Case] = {
    "fp16": Case(one(attention_spec(block_size=16, heads=H, head_size=D)), FA),
    "bf16": Case(one(attention_spec(block_size=16, heads=H, head_size=D, model_dtype=torch.bfloat16)),
                 FA | {"model_dtype": torch.bfloat16}, expect=((ATT, DType.BF16, Packing.KV),)),
    "fp32": Case(one(attention_spec(block_size=16, heads=H, head_size=D, model_dtype=torch.float32)),
                 FA | {"model_dtype": torch.float32}, expect=((ATT, DType.FP32, Packing.KV),)),
    "fp8": Case(one(attention_spec(block_size=16, heads=H, head_size=D, cache_dtype="fp8")),
                FA | {"cache_dtype": "fp8"}, expect=((ATT, DType.FP8_E4M3, Packing.KV),)),
    "fp8_e5m2": Case(one(attention_spec(block_size=16, heads=H, head_size=D, cache_dtype="fp8_e5m2")),
                     FA | {"cache_dtype": "fp8_e5m2"}, expect=((ATT, DType.FP8_E5M2, Packing.KV),)),
    "head_size_v": Case(one(attention_spec(block_size=16, heads=H, head_size=D, head_size_v=32)), FA),
    "cpu_fp16": Case(one(attention_spec(block_size=32, heads=H, head_size=D)), layouts=HND,
                     expect=((ATT, DType.FP16, Packing.CPU_KT),)),
    "cpu_fp8": Case(one(attention_spec(block_size=32, heads=H, head_size=D, cache_dtype="fp8")), {"cache_dtype": "fp8"},
                    layouts=HND, expect=((ATT, DType.FP8_E4M3, Packing.CPU_KT),)),
    "nvfp4": Case(one(nvfp4_spec(block_size=16, heads=H, head_size=D)), FI | {"cache_dtype": "nvfp4"},
                  layouts=PAGE_GRID, expect=((CacheKind.QUANTIZED, DType.NVFP4, Packing.KV),)),
    "nvfp4_kernel_blocks": Case(one(nvfp4_spec(block_size=64, heads=H, head_size=D)),
                                FI | {"cache_dtype": "nvfp4", "kernel_block_sizes": [16]}, layouts=LAYER_OUTER,
                                expect=((CacheKind.QUANTIZED, DType.NVFP4, Packing.KV),)),
    "kv_planes": Case(one(attention_spec(block_size=16, heads=H, head_size=D, backend=RocmAttentionBackend)),
                      {"backend": RocmAttentionBackend}, expect=((CacheKind.KV_PLANES, DType.FP16, Packing.KV),)),
    "kv_planes_kernel_blocks": Case(
        one(attention_spec(block_size=64, heads=H, head_size=D, backend=RocmAttentionBackend)),
        {"backend": RocmAttentionBackend, "kernel_block_sizes": [32]}, layouts=LAYER_OUTER,
        expect=((CacheKind.KV_PLANES, DType.FP16, Packing.KV),)),
    "kernel_blocks": Case(one(attention_spec(block_size=64, heads=H, head_size=D)), FA | {"kernel_block_sizes": [32]},
                          layouts=LAYER_OUTER),
    "mla": Case(one(mla_spec(block_size=16)), FA, expect=((CacheKind.MLA, DType.FP16, Packing.KV),)),
    "mla_fp8": Case(one(mla_spec(block_size=16, cache_dtype="fp8")), FA | {"cache_dtype": "fp8"},
                    expect=((CacheKind.MLA, DType.INT8, Packing.KV),)),
    "mla_fp8_ds_rows": Case(one(mla_spec(block_size=16, cache_dtype="fp8_ds_mla", state_content_bytes=656)),
                            FA | {"cache_dtype": "fp8_ds_mla"}, expect=((CacheKind.MLA, DType.INT8, Packing.KV),)),
    "mla_padded": Case(one(mla_spec(block_size=16, alignment=4096)), FA,
                       expect=((CacheKind.MLA, DType.FP16, Packing.KV),)),
    "mamba": Case(one(mamba_spec()), expect=((CacheKind.MAMBA, DType.INT8, Packing.KV),)),
    "mamba_padded": Case(one(mamba_spec(page_size_padded=8192)), expect=((CacheKind.MAMBA, DType.INT8, Packing.KV),)),
    "sliding_window_and_full": Case(
        lambda: [GroupDef(L4[::2], attention_spec(block_size=16, heads=H, head_size=D)),
                 GroupDef(L4[1::2], attention_spec(block_size=16, heads=H, head_size=D, window=32))],
        FA, expect=((ATT, DType.FP16, Packing.KV),) * 2),
    "sliding_window_and_full_1_2": Case(
        lambda: [GroupDef(L3[:1], attention_spec(block_size=16, heads=H, head_size=D)),
                 GroupDef(L3[1:], attention_spec(block_size=16, heads=H, head_size=D, window=32))],
        FA, expect=((ATT, DType.FP16, Packing.KV),) * 2),
    "attention_and_mamba": Case(
        lambda: [GroupDef(L3[:2], attention_spec(block_size=16, heads=H, head_size=D)),
                 GroupDef(L3[2:], mamba_spec(block_size=16, page_size_padded=16 * H * 2 * D * 2))],
        FA, expect=((ATT, DType.FP16, Packing.KV), (CacheKind.MAMBA, DType.INT8, Packing.KV))),
    "attention_and_mamba_mixed_pages": Case(
        lambda: [GroupDef(L3[:2], attention_spec(block_size=16, heads=H, head_size=D)),
                 GroupDef(L3[2:], mamba_spec(block_size=16))],
        FA, layouts=(), expect=((ATT, DType.FP16, Packing.KV), (CacheKind.MAMBA, DType.INT8, Packing.KV))),
}  # fmt: skip

#: Combinations vLLM's planner or allocator refuses (so there is nothing for kvxfer to describe).
VLLM_REFUSES = {
    "kernel_blocks": tuple(x for x in ALL if x not in LAYER_OUTER),
    "kv_planes_kernel_blocks": tuple(x for x in ALL if x not in LAYER_OUTER),
    "nvfp4_kernel_blocks": tuple(x for x in ALL if x not in LAYER_OUTER),
    "attention_and_mamba_mixed_pages": (VLayout.LBHNC, VLayout.LBNHC, VLayout.LHBNC, VLayout.BHLNC),
}


def _params() -> list[Any]:
    out = []
    for name, case in CASES.items():
        for lay in (*(x for x in case.layouts if x not in case.bugs), *case.bugs):
            marks = [pytest.mark.xfail(strict=True, reason=case.bugs[lay])] if lay in case.bugs else []
            out.append(pytest.param(name, lay, id=f"{name}-{lay.name}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "layout"), _params())
def test_layout_bytes_are_where_vllm_puts_them(name: str, layout: VLayout) -> None:
    case = CASES[name]
    eng = build_engine(case.groups(), layout=layout, **case.kw)
    groups = eng.describe()
    assert [(g.layout.kind, g.layout.dtype, g.layout.packing) for g in groups] == list(case.expect)
    for g, vllm_group in zip(groups, eng.kv_cache_config.kv_cache_groups, strict=True):
        lay = g.layout
        assert g.layer_names == tuple(vllm_group.layer_names)
        assert lay.num_layers == len(g.layer_names)
        assert lay.num_blocks == eng.kv_cache_config.num_blocks
        assert lay.block_size == (1 if lay.kind is CacheKind.MAMBA else vllm_group.kv_cache_spec.block_size)
        assert lay.stride_order == layout.name or lay.kind in (CacheKind.MLA, CacheKind.MAMBA)
        # Each region starts where vLLM's view of its first layer starts.
        for i, layer in enumerate(g.layer_names):
            if lay.layer_offset(i) == 0:
                assert g.region_addresses[lay.region_of_layer(i)] == eng.kv_caches[layer].data_ptr()
        assert check_group_against_vllm(eng, g) > 0
    if len(groups) == 2:
        # vLLM's groups overlay one allocation from its first byte: their first layers share an address.
        assert groups[0].region_addresses[0] == groups[1].region_addresses[0]


@pytest.mark.parametrize(
    ("name", "layout"), [pytest.param(n, lay, id=f"{n}-{lay.name}") for n, lays in VLLM_REFUSES.items() for lay in lays]
)
def test_combinations_vllm_itself_refuses(name: str, layout: VLayout) -> None:
    """The matrix above leaves these out because vLLM never hands them over (if vLLM starts to, cover them)."""
    case = CASES[name]
    with pytest.raises((ValueError, AssertionError)):
        build_engine(case.groups(), layout=layout, **case.kw)


def test_kernel_blocks_and_padding_are_read_from_vllm() -> None:
    """kvxfer's kernel block size and page stride are vLLM's (not guessed from a tensor's shape)."""
    eng = build_engine(CASES["kernel_blocks"].groups(), **CASES["kernel_blocks"].kw)
    (g,) = eng.describe()
    assert eng.kv_caches[L3[0]].shape[0] == 2 * eng.kv_cache_config.num_blocks
    assert (g.layout.block_size, g.layout.kernel_block_size, g.layout.kernel_blocks_per_block) == (64, 32, 2)
    spec = mla_spec(block_size=16, alignment=4096)
    (g,) = build_engine(one(spec)(), **FA).describe()
    assert spec.page_size_padded == 5 * 4096  # 16 rows of 576 fp16 elements, rounded up to the alignment
    assert (g.layout.page_bytes, g.layout.padded_page_bytes) == (16 * 576 * 2, 5 * 4096)
    ms = mamba_spec(page_size_padded=8192)
    (g,) = build_engine(one(ms)()).describe()
    assert (g.layout.page_bytes, g.layout.padded_page_bytes) == (ms.state_content_size_bytes, 8192)


def _conv_layout(monkeypatch: pytest.MonkeyPatch, name: str | None) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    if name is None:
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", name)
    get_conv_state_layout.cache_clear()


@pytest.fixture
def conv_layout(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets vLLM's conv state layout (its value is cached by vLLM: cleared before and after)."""
    yield lambda name: _conv_layout(monkeypatch, name)
    _conv_layout(monkeypatch, None)


def test_mamba_tp_split_is_vllms_own_conv_split(conv_layout: Any) -> None:
    """With the DS conv layout the segments are vLLM's sub-projections (derive_mamba_conv_split) then the
    temporal state, as this rank's bytes; the SD layout, other mamba types and a replicated state differ."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as M

    from kvxfer.integrations.vllm.spec import mamba_tp_split, transfer_groups

    conv_layout("DS")
    # Mamba2 at TP 2: x 16 + B 4 + C 4 over 2 ranks, 3 conv rows of fp16; 1 head of (8, 16) fp32.
    m2 = MambaSpec(block_size=16, shapes=((12, 3), (1, 8, 16)), dtypes=(torch.float16, torch.float32),
                   mamba_type=M.MAMBA2)  # fmt: skip
    assert mamba_tp_split(m2, 2) == ((8 * 6, 2 * 6, 2 * 6, 8 * 16 * 4), False)
    # Mamba1: x only; its temporal state is (intermediate / TP, d_state).
    m1 = MambaSpec(block_size=16, shapes=((32, 3), (32, 16)), dtypes=(torch.float16, torch.float32),
                   mamba_type=M.MAMBA1)  # fmt: skip
    assert mamba_tp_split(m1, 4) == ((32 * 6, 32 * 16 * 4), False)
    # GDN: Q, K (equal), V; temporal (v heads, v dim, k dim).
    gdn = MambaSpec(block_size=16, shapes=((2 * 8 + 16, 3), (2, 8, 4)), dtypes=(torch.bfloat16, torch.float32),
                    mamba_type=M.GDN_ATTN)  # fmt: skip
    assert mamba_tp_split(gdn, 2) == ((8 * 6, 8 * 6, 16 * 6, 2 * 8 * 4 * 4), False)
    short = MambaSpec(block_size=16, shapes=((12, 3), (1, 8, 16)), dtypes=(torch.float16, torch.float32),
                      mamba_type=M.SHORT_CONV)  # fmt: skip
    assert mamba_tp_split(short, 2) == ((), False)  # vLLM's connector does not split it either
    rep = MambaSpec(block_size=16, shapes=((12, 3),), dtypes=(torch.float16,), tp_replicated=True)
    assert mamba_tp_split(rep, 2) == ((), True)
    # Described from an engine: the layout carries the segments, the scheduler's group knows it moves.
    eng = build_engine(one(m2)(), tp_size=2, tp_rank=1)
    (g,) = eng.describe()
    assert g.layout.segments == (48, 12, 12, 512)
    assert [t.tp_split for t in transfer_groups(eng.kv_cache_config, 2)] == [True]
    conv_layout("SD")
    assert mamba_tp_split(m2, 2) == ((), False)
    (g,) = eng.describe()
    assert g.layout.segments == ()
    assert [t.tp_split for t in transfer_groups(eng.kv_cache_config, 2)] == [False]


# ------------------------------------------------------------------------------ refusals
def refusal(field_name: str, *fragments: str) -> Callable[[KVCacheDescriptionError], None]:
    def check(exc: KVCacheDescriptionError) -> None:
        assert exc.field == field_name, exc.message
        for f in fragments:
            assert f in exc.message, exc.message

    return check


def _refused_engine(kind: str) -> Any:
    """Engines kvxfer must refuse, each built with vLLM's code."""
    spec = attention_spec(block_size=16, heads=H, head_size=D)
    if kind == "tokens_per_state":
        return build_engine(one(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float16,
                                                  tokens_per_state=4))(), **FA)  # fmt: skip
    if kind == "head_slots":  # K and V as head groups without nvfp4: a packing kvxfer does not know
        odd = attention_spec(block_size=16, heads=H, head_size=D, num_head_slots=2 * H, state_content_bytes=2 * D)
        return build_engine(one(odd)(), **FA)
    if kind == "int8_per_token_head":  # Triton's packing: inline fp32 scales after each head's data
        q = attention_spec(block_size=16, heads=H, head_size=D, cache_dtype="int8_per_token_head",
                           backend=TritonAttentionBackend)  # fmt: skip
        return build_engine(one(q)(), backend=TritonAttentionBackend, cache_dtype="int8_per_token_head")
    if kind == "dcp":
        return build_engine(one(spec)(), dcp=2, **FA)
    if kind == "strides":  # the views are LBNHC, the config says LBHNC
        eng = build_engine(one(spec)(), layout=VLayout.LBNHC, **FA)
        eng.kv_cache_config.kv_cache_layout = "LBHNC"
        return eng
    if kind == "layout_name":
        eng = build_engine(one(spec)(), **FA)
        eng.kv_cache_config.kv_cache_layout = "SHUFFLE"
        return eng
    if kind == "no_caches":
        eng = build_engine(one(spec)(), **FA)
        eng.kv_caches = {}
        return eng
    if kind == "cpu_nhd":
        return build_engine(one(attention_spec(block_size=32, heads=H, head_size=D))(), layout=VLayout.LBNHC)
    if kind == "nvfp4_heads_outer":  # FlashInfer's _nvfp4_kv_views refuses the pages as not dense
        return build_engine(one(nvfp4_spec(block_size=16, heads=H, head_size=D))(), layout=VLayout.LHBNC,
                            cache_dtype="nvfp4", **FI)  # fmt: skip
    if kind == "nvfp4_other_backend":  # the same spec fields, another kernel's arrangement (vLLM 0.33's MiniMax-M3)
        return build_engine(one(nvfp4_spec(block_size=16, heads=H, head_size=D))(), cache_dtype="nvfp4",
                            backend=MiniMaxMsaName)  # fmt: skip
    raise AssertionError(kind)


REFUSALS = {
    "tokens_per_state": refusal("tokens_per_state", "tokens_per_state=4", "model.layers.0.self_attn.attn"),
    "head_slots": refusal("num_head_slots", "num_head_slots=8", f"state_content_bytes={2 * D}"),
    "int8_per_token_head": refusal("kv_quant_mode", "kv_quant_mode=INT8_PER_TOKEN_HEAD", "int8_per_token_head"),
    "dcp": refusal("decode_context_parallel_size", "decode_context_parallel_size: 2"),
    "strides": refusal("kv_caches", "kv_caches['model.layers.0.self_attn.attn']", "strides", "LBHNC"),
    "layout_name": refusal("kv_cache_layout", "'SHUFFLE'"),
    "no_caches": refusal("kv_caches", "no KV-cache tensors"),
    "cpu_nhd": refusal("kv_cache_spec", "cpu_kt", "LBNHC"),
    "nvfp4_heads_outer": refusal("kv_cache_spec", "nvfp4", "LHBNC"),
    "nvfp4_other_backend": refusal("attn_backend", "CUTLASS_MSA", "FLASHINFER"),
}


@pytest.mark.parametrize(
    "kind",
    list(REFUSALS),
)
def test_what_kvxfer_cannot_move_is_refused_naming_vllms_field(kind: str) -> None:
    eng = _refused_engine(kind)
    with pytest.raises(KVCacheDescriptionError) as info:
        eng.describe()
    REFUSALS[kind](info.value)


# ------------------------------------------------------------------------------ the connector class
def test_supported_versions_are_one_list_and_include_this_vllm() -> None:
    assert integration.SUPPORTED_VLLM == spec_module.SUPPORTED_VLLM
    assert vllm_version_supported(vllm.__version__)


def test_connector_implements_vllms_interface() -> None:
    """Every abstract method is implemented, and every method kvxfer overrides takes what vLLM passes to the base's."""
    cls = integration.KvxferConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert issubclass(cls, SupportsHMA)
    assert not inspect.isabstract(cls)
    for base in (KVConnectorBase_V1, SupportsHMA):
        for name in base.__abstractmethods__:
            assert name in cls.__dict__, f"{name} of {base.__name__} is not implemented"
    checked = []
    for name in cls.__dict__:
        if name.startswith("__") and name != "__init__":
            continue
        base = next((b for b in (KVConnectorBase_V1, SupportsHMA) if name in vars(b)), None)
        if base is None or not callable(getattr(cls, name)):
            continue
        assert_compatible(name, inspect.signature(getattr(cls, name)), inspect.signature(getattr(base, name)))
        checked.append(name)
    assert {"__init__", "register_kv_caches", "start_load_kv", "get_num_new_matched_tokens", "request_finished",
            "request_finished_all_groups", "get_required_kvcache_layout"} <= set(checked)  # fmt: skip


def assert_compatible(name: str, ours: inspect.Signature, theirs: inspect.Signature) -> None:
    """Every call vLLM may make with the base class's signature binds to ours, to the same parameters."""
    mine = list(ours.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in mine)
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in mine)
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(theirs.parameters.values()):
        if p.kind is p.VAR_POSITIONAL:
            assert var_pos, f"{name}: the base takes *{p.name}"
        elif p.kind is p.VAR_KEYWORD:
            assert var_kw, f"{name}: the base takes **{p.name}"
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            got = positional[i] if i < len(positional) else None
            assert var_pos or (got is not None and got.name == p.name), (
                f"{name}: parameter {i} is {p.name!r} in vLLM's base, {got.name if got else None!r} in kvxfer's"
            )
            if got is not None and p.default is not p.empty:
                assert got.default is not got.empty, f"{name}: {p.name} has a default in vLLM's base only"
        else:  # keyword-only
            assert p.name in ours.parameters or var_kw, f"{name}: keyword {p.name!r} is not accepted"
    for p in mine:  # what kvxfer adds must not be required
        if p.name not in theirs.parameters and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert p.default is not p.empty, f"{name}: kvxfer requires {p.name!r}, which vLLM does not pass"


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_vllms_factory_resolves_the_connector_by_module_path(role: str) -> None:
    config = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                              kv_role=role)  # fmt: skip
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is integration.KvxferConnector
    assert KVConnectorFactory.supports_hma_config(config)
    # vLLM 0.33 asks this when sleep mode is on (VllmConfig's check, MultiConnector): kvxfer says no.
    assert cls.supports_sleep_mode(config) is False


@pytest.mark.parametrize(("choice", "use_mla", "expected"),
                         [("HND", False, "LBHNC"), ("cross_layer", False, "BLHNC"), ("auto", False, None),
                          ("HND", True, None)])  # fmt: skip
def test_required_layout_is_one_vllm_knows(choice: str, use_mla: bool, expected: str | None) -> None:
    config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"kv_cache_layout": choice}),
    )
    got = integration.KvxferConnector.get_required_kvcache_layout(config)
    assert got == expected
    if got is not None:
        assert VLayout[got].name == got
