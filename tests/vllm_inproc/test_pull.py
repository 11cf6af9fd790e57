"""Requests moved by the connector's halves between vLLM-made caches, through real sidecars.

A prefill and a decode "instance" (:mod:`tests.vllm_inproc.pd`) hold caches that vLLM's own code
planned and allocated (:mod:`tests.vllm_inproc.engine`); the prefill side's cells are written
through vLLM's accessors (or vLLM's CPU attention kernel), one request moves through the
scheduler and worker halves, and the decode side is read back through the accessors vLLM's
attention backends use, token by token and head by head. Every decode instance loads the prompt
but its last token, which it computes itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata
from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.v1.kv_cache_interface import KVCacheSpec

from kvxfer.layout import Packing
from tests.cpu_features import require_fp8_kv_cache
from tests.vllm_inproc.engine import (
    CPUAttentionBackend,
    Engine,
    FlashAttentionBackend,
    FlashInferName,
    GroupDef,
    attention_spec,
    build_engine,
    default_layers,
    mamba_spec,
    mla_spec,
    nvfp4_spec,
    vllm_parts,
)
from tests.vllm_inproc.pd import PD, Instance, block_rows, decode_request, fill_random, token_rows

LAYERS = default_layers("self_attn.attn", 2)
HEADS, HEAD = 4, 64
NB = 24  # blocks per engine (block 0 is vLLM's null block: never in a table here)


#: A layer spec for a number of KV heads per rank.
SpecFor = Callable[[int], KVCacheSpec]


def engines(
    spec_for: SpecFor | None = None, *, groups: Sequence[GroupDef] = (), tp: int = 1, seed: int,
    total_kv_heads: int = HEADS, **kw: Any,
) -> list[Engine]:  # fmt: skip
    """One engine per rank (``LAYERS`` with ``spec_for``, or ``groups``), cells random (seed ``seed + rank``).

    The attention layers say they run a GPU backend (K|V per head and token) unless ``backend`` is given.
    """
    out = []
    kw.setdefault("backend", FlashAttentionBackend)
    for r in range(tp):
        gs = list(groups) if spec_for is None else [GroupDef(LAYERS, spec_for(HEADS // tp))]
        eng = build_engine(gs, num_blocks=NB, tp_rank=r, tp_size=tp, total_kv_heads=total_kv_heads, **kw)
        fill_random(eng, seed + r)
        out.append(eng)
    return out


def rows(insts: Sequence[Engine], layer: str, table: Sequence[int], tokens: range) -> torch.Tensor:
    """(token, head, bytes) of a request over every rank of an instance, heads in global order."""
    return torch.cat([token_rows(e, layer, table, tokens) for e in insts], dim=1)


def blocks_for(tokens: int, block_size: int, pool: Sequence[int]) -> list[int]:
    return list(pool[: math.ceil(tokens / block_size)])


P_POOL = [5, 9, 2, 7, 13, 21, 17, 3, 11, 23, 1, 16]
D_POOL = [3, 11, 4, 20, 8, 6, 15, 19, 1, 22, 10, 14]


# ------------------------------------------------------------------------------ vLLM's CPU kernels
class CpuAttention:
    """vLLM's CPU attention implementation (``CPUAttentionBackendImpl``) of one layer, as the model runner uses it."""

    def __init__(self, cache_dtype: str, num_heads: int = 2 * HEADS) -> None:
        config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.float16),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        )
        with set_current_vllm_config(config):  # type: ignore[arg-type]
            self.impl = CPUAttentionBackendImpl(
                num_heads=num_heads, head_size=HEAD, scale=HEAD**-0.5, num_kv_heads=HEADS, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype=cache_dtype,
            )  # fmt: skip
        self.cache_dtype = cache_dtype
        self.num_heads = num_heads
        self.layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)

    def write(self, kv_cache: torch.Tensor, table: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Store tokens 0..len(key) of a request whose block table is ``table`` (``do_kv_cache_update``)."""
        bs = kv_cache.shape[2]
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(key.shape[0])], dtype=torch.int64)
        self.impl.do_kv_cache_update(self.layer, key, value, kv_cache, slots)  # type: ignore[arg-type]

    def decode(self, kv_cache: torch.Tensor, table: Sequence[int], seq_len: int, query: torch.Tensor) -> torch.Tensor:
        """Attention of one decode query over the request's first ``seq_len`` cached tokens (``forward``)."""
        from vllm import _custom_ops as ops

        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq = torch.tensor([seq_len], dtype=torch.int32)
        meta = CPUAttentionMetadata(
            num_actual_tokens=1, max_query_len=1, query_start_loc=qsl, max_seq_len=seq_len, seq_lens=seq,
            block_table=torch.tensor([list(table)], dtype=torch.int32), slot_mapping=torch.tensor([seq_len - 1]),
            scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=self.num_heads, num_kv_heads=HEADS, head_dim=HEAD, seq_lens=seq,
                dtype=torch.float16, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec",
                enable_kv_split=False, kv_cache_dtype=self.cache_dtype,
            ),
        )  # fmt: skip
        out = torch.zeros(1, self.num_heads, HEAD, dtype=torch.float16)
        self.impl.forward(self.layer, query, query, query, kv_cache, meta, out)  # type: ignore[arg-type]
        return out


def cpu_engine(block_size: int, cache_dtype: str) -> Engine:
    spec = attention_spec(block_size=block_size, heads=HEADS, head_size=HEAD, cache_dtype=cache_dtype)
    return build_engine([GroupDef(LAYERS, spec)], backend=CPUAttentionBackend, isa="vec", cache_dtype=cache_dtype,
                        num_blocks=NB)  # fmt: skip


@pytest.mark.kernels
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(("p_bs", "d_bs"), [(32, 64), (64, 32)])
def test_cpu_kernel_pages_between_block_sizes(pd: PD, cache_dtype: str, p_bs: int, d_bs: int) -> None:
    """vLLM's CPU kernels store K transposed per (block, head): a pull between block sizes re-tiles it exactly.

    The prefill cache is written by vLLM's ``do_kv_cache_update``; the decode cache must equal a reference
    cache of the decode block size written by the same kernel directly, byte for byte and in the attention
    vLLM's kernel computes over it.
    """
    if cache_dtype == "fp8":
        require_fp8_kv_cache()
    attn = CpuAttention(cache_dtype)
    pre_eng, dec_eng, ref_eng = (
        cpu_engine(p_bs, cache_dtype),
        cpu_engine(d_bs, cache_dtype),
        cpu_engine(d_bs, cache_dtype),
    )
    fill_random(dec_eng, 3)
    prompt = 150
    p_table, d_table = blocks_for(prompt, p_bs, P_POOL), blocks_for(prompt, d_bs, D_POOL)
    gen = torch.Generator().manual_seed(7)
    kv = {n: (torch.randn(prompt, HEADS, HEAD, generator=gen).half(), torch.randn(prompt, HEADS, HEAD, generator=gen)
              .half()) for n in LAYERS}  # fmt: skip
    loaded = prompt - 1
    for n, (k, v) in kv.items():
        attn.write(pre_eng.kv_caches[n], p_table, k, v)
        attn.write(ref_eng.kv_caches[n], d_table, k[:loaded], v[:loaded])
    pre = pd.instance("prefill", [pre_eng])
    dec = pd.instance("decode", [dec_eng])
    assert pre_eng.describe()[0].layout.packing is Packing.CPU_KT
    params = pd.publish(pre, "cpu", prompt, [p_table])
    assert pd.load(dec, "cpu-d", prompt, params, [d_table]) == set()
    pre.finished(sending="cpu")
    query = torch.randn(1, attn.num_heads, HEAD, generator=gen).half()
    for n in LAYERS:
        # K (transposed) and V of every loaded token and head, read as vLLM's CPU kernel reads them.
        got = token_rows(dec_eng, n, d_table, range(loaded))
        assert torch.equal(got, token_rows(ref_eng, n, d_table, range(loaded)))
        assert torch.equal(got, token_rows(pre_eng, n, p_table, range(loaded)))
        out = attn.decode(dec_eng.kv_caches[n], d_table, loaded, query)
        ref = attn.decode(ref_eng.kv_caches[n], d_table, loaded, query)
        assert out.abs().sum() > 0
        assert torch.equal(out, ref)


# ------------------------------------------------------------------------------ standard K|V packing
def kv_spec(block_size: int) -> SpecFor:
    return lambda heads: attention_spec(block_size=block_size, heads=heads, head_size=HEAD)


@pytest.mark.parametrize(("p_tp", "p_bs", "d_tp", "d_bs"), [(2, 16, 1, 32), (1, 32, 2, 16), (2, 32, 1, 16)])
def test_standard_kv_heterogeneous_tp_and_block_sizes(pd: PD, p_tp: int, p_bs: int, d_tp: int, d_bs: int) -> None:
    """K|V per head and token (a GPU backend's layout): each decode rank gets its heads from the prefill ranks."""
    pre = pd.instance(
        "prefill", engines(tp=p_tp, seed=1, spec_for=kv_spec(p_bs)), sidecars="pre1kv" if d_tp > p_tp else ""
    )
    dec = pd.instance("decode", engines(tp=d_tp, seed=11, spec_for=kv_spec(d_bs)))
    prompt = 75
    p_table, d_table = blocks_for(prompt, p_bs, P_POOL), blocks_for(prompt, d_bs, D_POOL)
    params = pd.publish(pre, "kv", prompt, [p_table])
    assert params["tp_size"] == p_tp
    assert len(params["kvxfer_addresses"]) == p_tp
    assert pd.load(dec, "kv-d", prompt, params, [d_table]) == set()
    pre.finished(sending="kv")  # every prefill rank was read and frees its blocks
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


def test_the_workers_own_agents_move_heterogeneous_tp(pd: PD) -> None:
    """data_plane "worker": each rank's own NIXL agent registered vLLM's tensors; the sidecars map nothing."""
    pre = pd.instance("prefill", engines(tp=2, seed=3, spec_for=kv_spec(16)), sidecars="prew2", data_plane="worker")
    dec = pd.instance("decode", engines(tp=1, seed=13, spec_for=kv_spec(32)), sidecars="decw1", data_plane="worker")
    assert all(w.agent is not None for w in (*pre.workers, *dec.workers))
    assert all(w.registration["backend"] == "worker" for w in (*pre.workers, *dec.workers))
    prompt = 75
    p_table, d_table = blocks_for(prompt, 16, P_POOL), blocks_for(prompt, 32, D_POOL)
    params = pd.publish(pre, "wk", prompt, [p_table])
    assert pd.load(dec, "wk-d", prompt, params, [d_table]) == set()
    pre.finished(sending="wk")
    agent = dec.workers[0].agent
    assert agent is not None
    assert agent.jobs_run == 2  # one READ per prefill rank, run by the decode worker's own agent
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


def test_gather_by_the_worker_is_for_gpu_caches_and_host_caches_are_moved_by_the_sidecar(
    pd: PD, caplog: pytest.LogCaptureFixture
) -> None:
    """gather "worker" asks the sidecar to hand same-host GPU pulls to the worker; CPU caches stay the sidecar's."""
    pre = pd.instance("prefill", engines(tp=1, seed=4, spec_for=kv_spec(16)))
    with caplog.at_level(logging.INFO, logger="kvxfer.vllm.worker"):
        dec = pd.instance("decode", engines(tp=1, seed=14, spec_for=kv_spec(16)), gather="worker")
    assert all(w.gather is None for w in dec.workers)
    assert "gather: 'worker' applies to GPU caches" in caplog.text
    prompt = 40
    p_table, d_table = blocks_for(prompt, 16, P_POOL), blocks_for(prompt, 16, D_POOL)
    params = pd.publish(pre, "gw", prompt, [p_table])
    assert pd.load(dec, "gw-d", prompt, params, [d_table]) == set()
    pre.finished(sending="gw")
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


def test_kernel_blocks_on_one_side(pd: PD) -> None:
    """A prefill block of 64 tokens that vLLM splits into kernel blocks of 32, into unsplit decode blocks of 32."""
    pre = pd.instance("prefill", engines(seed=2, spec_for=kv_spec(64), kernel_block_sizes=[32]))
    dec = pd.instance("decode", engines(seed=12, spec_for=kv_spec(32)))
    assert pre.engines[0].kv_caches[LAYERS[0]].shape[0] == 2 * NB  # vLLM's view: one entry per kernel block
    assert pre.engines[0].describe()[0].layout.kernel_block_size == 32
    prompt = 170
    p_table, d_table = blocks_for(prompt, 64, P_POOL), blocks_for(prompt, 32, D_POOL)
    params = pd.publish(pre, "kb", prompt, [p_table])
    assert pd.load(dec, "kb-d", prompt, params, [d_table]) == set()
    pre.finished(sending="kb")
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


def test_prefix_cache_hit_ends_inside_a_larger_prefill_block(pd: PD) -> None:
    """32 tokens are in the decode side's prefix cache: the pull starts halfway into the prefill's first block (64)."""
    pre = pd.instance("prefill", engines(seed=3, spec_for=kv_spec(64)))
    dec = pd.instance("decode", engines(seed=13, spec_for=kv_spec(16)))
    prompt, hit = 150, 32
    p_table, d_table = blocks_for(prompt, 64, P_POOL), blocks_for(prompt, 16, D_POOL)
    cached = {n: [block_rows(dec.engines[0], n, b) for b in d_table[:2]] for n in LAYERS}
    params = pd.publish(pre, "hit", prompt, [p_table])
    assert pd.load(dec, "hit-d", prompt, params, [d_table], computed=hit) == set()
    pre.finished(sending="hit")
    for n in LAYERS:
        tail = range(hit, prompt - 1)
        assert torch.equal(rows(dec.engines, n, d_table, tail), rows(pre.engines, n, p_table, tail))
        for b, before in zip(d_table[:2], cached[n], strict=True):  # the prefix-cache hit is untouched
            assert torch.equal(block_rows(dec.engines[0], n, b), before)
        assert not torch.equal(rows(dec.engines, n, d_table, range(hit)), rows(pre.engines, n, p_table, range(hit)))


# ------------------------------------------------------------------------------ other packings
def test_nvfp4_decode_tp2_from_prefill_tp1(pd: PD) -> None:
    """nvfp4 (FlashInfer's packing): each decode rank's heads get their data and scales where vLLM reads them."""

    def spec(block_size: int) -> SpecFor:
        return lambda heads: nvfp4_spec(block_size=block_size, heads=heads, head_size=HEAD)

    pre = pd.instance("prefill", engines(spec(32), seed=4, cache_dtype="nvfp4", backend=FlashInferName),
                      sidecars="pre1fp4")  # fmt: skip
    dec = pd.instance("decode", engines(spec(16), tp=2, seed=14, cache_dtype="nvfp4", backend=FlashInferName))
    assert list(vllm_parts(dec.engines[0], LAYERS[0])) == ["k_data", "k_scale", "v_data", "v_scale"]
    prompt = 90
    p_table, d_table = blocks_for(prompt, 32, P_POOL), blocks_for(prompt, 16, D_POOL)
    params = pd.publish(pre, "fp4", prompt, [p_table])
    assert pd.load(dec, "fp4-d", prompt, params, [d_table]) == set()
    pre.finished(sending="fp4")
    for n in LAYERS:
        # rows() concatenates nvfp4_split_data_scale's data and scale bytes of K, then V, per head.
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


def test_kv_planes_prefill_tp2_to_decode_tp1(pd: PD) -> None:
    """A K and a V plane per block (``num_head_slots=2``, ROCm's backend's packing): head slices land in place."""

    def spec(block_size: int) -> SpecFor:
        return lambda h: attention_spec(block_size=block_size, heads=h, head_size=HEAD, backend=RocmAttentionBackend)

    pre = pd.instance("prefill", engines(tp=2, seed=5, spec_for=spec(16), backend=RocmAttentionBackend))
    dec = pd.instance("decode", engines(seed=15, spec_for=spec(32), backend=RocmAttentionBackend))
    assert dec.engines[0].spec_of(LAYERS[0]).num_head_slots == 2
    prompt = 70
    p_table, d_table = blocks_for(prompt, 16, P_POOL), blocks_for(prompt, 32, D_POOL)
    params = pd.publish(pre, "planes", prompt, [p_table])
    assert pd.load(dec, "planes-d", prompt, params, [d_table]) == set()
    pre.finished(sending="planes")
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_mla_is_read_from_one_replica(pd: PD, p_tp: int, d_tp: int) -> None:
    """MLA's latent is replicated on every TP rank: a decode rank reads one prefill rank's copy (rank 0 here).

    The prefill ranks hold different bytes, so that a decode rank mixing replicas would show.
    """

    def make(_heads: int) -> KVCacheSpec:
        return mla_spec(block_size=16)

    pre = pd.instance("prefill", engines(tp=p_tp, seed=6, spec_for=make, total_kv_heads=1),
                      sidecars="pre1mla" if d_tp > p_tp else "")  # fmt: skip
    dec = pd.instance("decode", engines(tp=d_tp, seed=16, spec_for=make, total_kv_heads=1))
    prompt = 60
    p_table, d_table = blocks_for(prompt, 16, P_POOL), blocks_for(prompt, 16, D_POOL)
    params = pd.publish(pre, "mla", prompt, [p_table])
    assert pd.load(dec, "mla-d", prompt, params, [d_table]) == set()
    pre.finished(sending="mla")  # every prefill rank frees its copy, read or not
    tokens = range(prompt - 1)
    for n in LAYERS:
        want = token_rows(pre.engines[0], n, p_table, tokens)
        for e in dec.engines:
            assert torch.equal(token_rows(e, n, d_table, tokens), want)
        if p_tp > 1:
            assert not torch.equal(token_rows(pre.engines[1], n, p_table, tokens), want)


# ------------------------------------------------------------------------------ several KV-cache groups
SW_LAYERS = default_layers("self_attn.attn", 4)
MIXER_LAYERS = default_layers("mixer", 3)


def sliding_window_groups(window: int, bs: int) -> list[GroupDef]:
    """Full attention on the even layers, a sliding window on the odd ones (vLLM's hybrid allocator)."""
    full = attention_spec(block_size=bs, heads=HEADS, head_size=HEAD)
    sw = attention_spec(block_size=bs, heads=HEADS, head_size=HEAD, window=window)
    return [GroupDef(SW_LAYERS[::2], full), GroupDef(SW_LAYERS[1::2], sw)]


def hybrid_groups(bs: int) -> list[GroupDef]:
    """Two attention layers and a Mamba layer whose page is padded to the attention page."""
    attn = attention_spec(block_size=bs, heads=HEADS, head_size=HEAD)
    return [GroupDef(MIXER_LAYERS[:2], attn),
            GroupDef(MIXER_LAYERS[2:], mamba_spec(block_size=bs, page_size_padded=attn.page_size_bytes))]  # fmt: skip


def assert_mamba_state_moved(pre: Engine, dec: Engine, layer: str, p_state: int, d_state: int) -> None:
    """The conv and ssm states a Mamba layer cuts from the state block are equal on both sides, byte for byte."""
    p_states = pre.mamba[layer].bind(pre.kv_caches[layer])
    d_states = dec.mamba[layer].bind(dec.kv_caches[layer])
    assert [s.dtype for s in d_states] == [torch.float16, torch.float32]
    for got, want in zip(d_states, p_states, strict=True):
        assert torch.equal(got[d_state].view(torch.uint8), want[p_state].view(torch.uint8))


def test_sliding_window_and_full_attention_groups(pd: PD) -> None:
    """Full attention moves every loaded token; the sliding-window group only the window's tail blocks.

    The two groups overlay the same memory (vLLM's hybrid allocator): their block ids differ.
    """
    window, bs = 32, 16

    pre = pd.instance("prefill", engines(groups=sliding_window_groups(window, bs), seed=7))
    dec = pd.instance("decode", engines(groups=sliding_window_groups(window, bs), seed=17))
    prompt = 100  # 7 blocks; the window of the last 32 tokens lies in blocks 4..6
    p_full, p_sw = [5, 9, 2, 7, 13, 21, 17], [0, 0, 0, 0, 3, 11, 1]  # vLLM freed the blocks the window left
    d_full, d_sw = [3, 11, 4, 20, 8, 6, 15], [19, 1, 2, 5, 7, 9, 13]
    params = pd.publish(pre, "sw", prompt, [p_full, p_sw])
    assert params["remote_block_ids"] == [p_full, [3, 11, 1]]
    assert [g["first_block"] for g in params["kvxfer_groups"]] == [0, 4]
    full_layers, sw_layers = SW_LAYERS[::2], SW_LAYERS[1::2]
    before = {n: {b: block_rows(dec.engines[0], n, b) for b in d_sw} for n in sw_layers}
    assert pd.load(dec, "sw-d", prompt, params, [d_full, d_sw]) == set()
    pre.finished(sending="sw")
    loaded = prompt - 1
    for n in full_layers:
        assert torch.equal(rows(dec.engines, n, d_full, range(loaded)), rows(pre.engines, n, p_full, range(loaded)))
    for n in sw_layers:
        tail = range(4 * bs, loaded)
        assert torch.equal(rows(dec.engines, n, d_sw, tail), rows(pre.engines, n, p_sw, tail))
        changed = [b for b in d_sw if not torch.equal(block_rows(dec.engines[0], n, b), before[n][b])]
        assert changed == d_sw[4:], n  # blocks outside the window are untouched


def test_attention_and_mamba_groups(pd: PD) -> None:
    """The Mamba group's state block moves whole: the conv and ssm states a Mamba layer cuts from it are equal.

    The prefill instance stops one token short (vLLM cannot recompute a token on top of a moved Mamba
    state), and the decode instance loads exactly those tokens.
    """
    bs = 16
    layers = MIXER_LAYERS
    pre = pd.instance("prefill", engines(groups=hybrid_groups(bs), seed=8))
    dec = pd.instance("decode", engines(groups=hybrid_groups(bs), seed=18))
    prompt = 70
    p_attn, d_attn = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    p_state, d_state = 22, 23
    req_params = pd.publish(pre, "hyb", prompt, [p_attn, [p_state]])
    assert req_params["remote_num_tokens"] == prompt - 1  # the prefill stopped a token short
    assert req_params["remote_block_ids"][1] == [p_state]
    assert pd.load(dec, "hyb-d", prompt, req_params, [d_attn, [d_state]]) == set()
    pre.finished(sending="hyb")
    for n in layers[:2]:
        loaded = range(prompt - 1)
        assert torch.equal(rows(dec.engines, n, d_attn, loaded), rows(pre.engines, n, p_attn, loaded))
    mamba = layers[2]
    assert_mamba_state_moved(pre.engines[0], dec.engines[0], mamba, p_state, d_state)


# A Mamba2 layer in vLLM's DS conv layout (VLLM_SSM_CONV_STATE_LAYOUT=DS), global sizes: the conv state
# is (x + B + C, conv rows) fp16, the SSM state (heads, head dim, d_state) fp32, each split over TP.
MAMBA2_X, MAMBA2_B, CONV_ROWS, MAMBA2_HEADS, MAMBA2_HEAD_DIM, MAMBA2_D_STATE = 16, 4, 3, 2, 8, 16


@pytest.fixture
def ds_conv_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    yield
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
    get_conv_state_layout.cache_clear()


def hybrid_ds_groups(bs: int, tp: int) -> list[GroupDef]:
    """Two attention layers and a Mamba2 layer (DS conv layout) as one of ``tp`` ranks holds them."""
    attn = attention_spec(block_size=bs, heads=HEADS // tp, head_size=HEAD)
    conv = ((MAMBA2_X + 2 * MAMBA2_B) // tp, CONV_ROWS)
    ssm = (MAMBA2_HEADS // tp, MAMBA2_HEAD_DIM, MAMBA2_D_STATE)
    mamba = mamba_spec(shapes=(conv, ssm), block_size=bs, page_size_padded=attn.page_size_bytes)
    return [GroupDef(MIXER_LAYERS[:2], attn), GroupDef(MIXER_LAYERS[2:], mamba)]


def global_mamba2_state(insts: Sequence[Engine], layer: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole Mamba2 state of ``block`` as bytes, put together from every rank's conv and SSM states:
    x of every rank, then B of every rank, then C; the SSM heads of every rank."""
    tp = len(insts)
    x, b = MAMBA2_X // tp, MAMBA2_B // tp
    convs, ssms = [], []
    for e in insts:
        conv, ssm = e.mamba[layer].bind(e.kv_caches[layer])
        convs.append(conv[block].view(torch.uint8))
        ssms.append(ssm[block].view(torch.uint8))
    parts = [c[:x] for c in convs] + [c[x : x + b] for c in convs] + [c[x + b :] for c in convs]
    return torch.cat(parts), torch.cat(ssms)


@pytest.mark.usefixtures("ds_conv_layout")
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_mamba2_state_between_tp_sizes(pd: PD, p_tp: int, d_tp: int) -> None:
    """With the DS conv layout a Mamba2 state moves between TP sizes: each decode rank gets its slice of
    x, B, C and the SSM heads from the prefill ranks holding them, and the state the decode ranks hold
    together is the prefill ranks' state, byte for byte."""
    bs = 16
    pre = pd.instance("prefill", engines(groups=hybrid_ds_groups(bs, p_tp), tp=p_tp, seed=9),
                      sidecars="pre1mamba" if d_tp > p_tp else "")  # fmt: skip
    dec = pd.instance("decode", engines(groups=hybrid_ds_groups(bs, d_tp), tp=d_tp, seed=19))
    mamba = MIXER_LAYERS[2]
    segments = [g.layout.segments for g in dec.engines[0].describe() if g.layout.kind.value == "mamba"]
    x, b, ssm = MAMBA2_X // d_tp, MAMBA2_B // d_tp, MAMBA2_HEADS // d_tp * MAMBA2_HEAD_DIM * MAMBA2_D_STATE * 4
    assert segments == [(x * CONV_ROWS * 2, b * CONV_ROWS * 2, b * CONV_ROWS * 2, ssm)]
    prompt = 70
    p_attn, d_attn = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    p_state, d_state = 22, 23
    params = pd.publish(pre, "m2tp", prompt, [p_attn, [p_state]])
    assert params["tp_size"] == p_tp
    assert params["kvxfer_groups"][1]["tp_split"] is True  # the prefill side knows its state's split too
    before = global_mamba2_state(dec.engines, mamba, d_state)
    assert pd.load(dec, "m2tp-d", prompt, params, [d_attn, [d_state]]) == set()
    pre.finished(sending="m2tp")
    for n in MIXER_LAYERS[:2]:
        loaded = range(prompt - 1)
        assert torch.equal(rows(dec.engines, n, d_attn, loaded), rows(pre.engines, n, p_attn, loaded))
    got, want = global_mamba2_state(dec.engines, mamba, d_state), global_mamba2_state(pre.engines, mamba, p_state)
    assert not torch.equal(before[0], want[0])  # the random cells differed before the load
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------ sidecars that outlive a configuration
def pull_rank_by_rank(dec: Instance, rid: str, prompt: int, params: dict[str, Any], table: list[int]) -> list[bool]:
    """Load a request with the decode ranks one after the other (a rank may lag a step); which ranks loaded."""
    req = decode_request(rid, prompt, params)
    n, _ = dec.scheduler.matched_tokens(req, 0)
    dec.scheduler.after_alloc(req, [table], n)
    plan = dec.scheduler.build_plan()
    ok = []
    for i, w in enumerate(dec.workers):
        w.on_step(plan)
        one = Instance(dec.engine_id, dec.engines[i : i + 1], [w], dec.scheduler)
        _, _, failed = one.finished(recving=rid)
        ok.append(not failed)
    return ok


def release_everywhere(inst: Instance, rid: str) -> None:
    """Drop a publish a failed pull left behind (the test's teardown checks that none is left)."""
    for w in inst.workers:
        w.sidecar.release(rid)


def test_reader_reconfigured_while_its_sidecar_ran(pd: PD) -> None:
    """Both instances restart with another cache dtype; their sidecars keep running.

    The first request afterwards is read from the one prefill rank by both decode ranks: the prefill
    side must hold it until both read it.
    """
    loaded = []
    for i, dtype in enumerate((torch.float16, torch.bfloat16)):

        def spec(heads: int, dt: torch.dtype = dtype) -> KVCacheSpec:
            return attention_spec(block_size=16, heads=heads, head_size=HEAD, model_dtype=dt)

        pre = pd.instance("prefill", engines(seed=30, spec_for=spec, model_dtype=dtype), sidecars="pre1cfg")
        dec = pd.instance("decode", engines(tp=2, seed=31, spec_for=spec, model_dtype=dtype), sidecars="dec2cfg")
        params = pd.publish(pre, f"cfg{i}", 40, [[1, 2, 3]])
        try:
            loaded.append(pull_rank_by_rank(dec, f"cfg{i}-d", 40, params, [4, 5, 6]))
            pre.finished(sending=f"cfg{i}", timeout=5)
        finally:
            release_everywhere(pre, f"cfg{i}")
            pd.close()
    assert loaded == [[True, True], [True, True]]


def test_prefill_tp_changed_while_its_sidecars_ran(pd: PD) -> None:
    """The prefill instance goes from TP 1 to TP 2 on the same sidecars; the decode instance's pulls keep working."""
    outcome = []
    for i, tp in enumerate((1, 2)):
        pre = pd.instance("prefill", engines(tp=tp, seed=32, spec_for=kv_spec(16)), sidecars="pre2cfg")
        dec = pd.instance("decode", engines(seed=33, spec_for=kv_spec(16)), sidecars="dec1cfg")
        params = pd.publish(pre, f"tp{i}", 40, [[1, 2, 3]])
        try:
            outcome.append(pd.load(dec, f"tp{i}-d", 40, params, [[4, 5, 6]]))
        finally:
            release_everywhere(pre, f"tp{i}")
            pd.close()
    assert outcome == [set(), set()]
