"""End to end through real gRPC servers and real NIXL (UCX) on loopback: every byte verified."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer.client import KvxferRpcError
from kvxfer.layout import KVCacheLayout
from tests.sidecar.helpers import Harness, attention, transfer

FRAGMENTED_P = [5, 6, 7, 1, 30, 31, 12, 40, 41, 42, 43, 2]
FRAGMENTED_D = [9, 3, 4, 50, 51, 52, 20, 21, 0, 60, 61, 62]


async def test_homogeneous_hnd_exact_bytes(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=1)
    # Same layout on both sides: the decode pages equal the prefill pages, byte for byte.
    src, dst = pw[0].buffers["kv"], dw[0].buffers["kv"]
    for layer in range(lay.num_layers):
        assert np.array_equal(dst.pages(layer)[FRAGMENTED_D], src.pages(layer)[FRAGMENTED_P])
    assert res.done
    assert res.bytes == len(FRAGMENTED_D) * lay.page_bytes * lay.num_layers
    assert res.remote_ranks == (0,)
    # Coalescing: runs contiguous on both sides become one descriptor per layer (9 runs here).
    assert res.descriptors == 9 * lay.num_layers


async def test_homogeneous_nhd(harness: Harness) -> None:
    lay = attention(order="NHD")
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=2)


@pytest.mark.parametrize("order", ["HND", "NHD"])
async def test_heterogeneous_tp_prefill2_decode1(harness: Harness, order: str) -> None:
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": attention(tp=2, order=order)}, {"kv": attention(tp=1, order=order)}, prefill_tp=2, decode_tp=1
    )
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=3)
    assert res.remote_ranks == (0, 1)
    if order == "NHD":
        assert any("NHD" in w for w in res.warnings)


@pytest.mark.parametrize("order", ["HND", "NHD"])
async def test_heterogeneous_tp_prefill1_decode2(harness: Harness, order: str) -> None:
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": attention(tp=1, order=order)}, {"kv": attention(tp=2, order=order)}, prefill_tp=1, decode_tp=2
    )
    events = asyncio.ensure_future(_first_event(pw[0], "RELEASED"))
    results = await transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=4)
    assert [r.remote_ranks for r in results] == [(0,), (0,)]
    # The one prefill rank frees its blocks only once both decode ranks confirmed.
    ev = await asyncio.wait_for(events, 10)
    assert ev.request_id == "r1"
    assert (await pw[0].client.status())["leases"] == 0


@pytest.mark.parametrize("expected", [False, True], ids=["pulled", "expected-then-pulled"])
async def test_mla_replicated_reads_one_rank_and_frees_the_other(harness: Harness, expected: bool) -> None:
    lay = KVCacheLayout.mla(num_layers=3, num_blocks=64, block_size=16, latent_dim=576)
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, prefill_tp=2, decode_tp=1)
    if expected:  # queued first (vLLM's Expect names every prefill rank): only the read replica is held
        await pw[0].prefill("r1", {"kv": FRAGMENTED_P}, salt=5)
        await pw[1].prefill("r1", {"kv": FRAGMENTED_P}, salt=5)
        assert await dw[0].client.expect("r1", [s.peer_address for s in ps])
        await asyncio.sleep(0.2)
        res = await dw[0].pull("r1", ps, {"kv": FRAGMENTED_D})
        assert dw[0].verify({"kv": FRAGMENTED_D}, 5) == (res.bytes, 0)
    else:
        (res,) = await transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=5)
    assert res.remote_ranks == (0,)
    # Rank 1's replica is never read: it is released by an UNREAD notice, not by lease expiry.
    for w in pw:
        for _ in range(100):
            if (await w.client.status())["leases"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await w.client.status())["leases"] == 0


async def test_hybrid_attention_plus_mamba_layer(harness: Harness) -> None:
    layouts = {
        "attention": attention(layers=3),
        "mamba": KVCacheLayout.mamba(num_layers=1, num_blocks=64, page_size_bytes=4000),
    }
    ps, pw, _ds, dw = await harness.deployment(layouts, layouts)
    (res,) = await transfer(
        pw, ps, dw, "r1", {"attention": FRAGMENTED_P, "mamba": [7, 8]}, {"attention": FRAGMENTED_D, "mamba": [33, 1]},
        salt=6,
    )  # fmt: skip
    assert res.bytes == 12 * layouts["attention"].page_bytes * 3 + 2 * 4000


#: A Mamba2 state in vLLM's DS conv layout, global bytes: x, B, C of the conv state, then the SSM state.
MAMBA_SEGMENTS = (384, 96, 96, 1024)


def mamba_split(tp: int, **kw: Any) -> KVCacheLayout:
    """The Mamba layout of one of ``tp`` ranks, its state split in TP segments."""
    local = tuple(s // tp for s in MAMBA_SEGMENTS)
    return KVCacheLayout.mamba(num_layers=2, num_blocks=64, page_size_bytes=sum(local), segments=local, **kw)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 4), (4, 2)])
async def test_mamba_state_split_between_tp_sizes(harness: Harness, p_tp: int, d_tp: int) -> None:
    """Every decode rank's Mamba page is its slice of each segment of the state the prefill ranks hold
    together (every byte checked against the global state), beside attention heads split the same way."""
    p_lay = {"attention": attention(layers=2, tp=p_tp), "mamba": mamba_split(p_tp, page_stride=4096)}
    d_lay = {"attention": attention(layers=2, tp=d_tp), "mamba": mamba_split(d_tp)}
    ps, pw, _ds, dw = await harness.deployment(p_lay, d_lay, prefill_tp=p_tp, decode_tp=d_tp)
    results = await transfer(
        pw, ps, dw, "r1", {"attention": FRAGMENTED_P, "mamba": [7, 8]}, {"attention": FRAGMENTED_D, "mamba": [33, 1]},
        salt=9,
    )  # fmt: skip
    for d, res in enumerate(results):
        first = d * p_tp // d_tp
        assert res.remote_ranks == tuple(range(first, max(first + 1, (d + 1) * p_tp // d_tp)))


async def test_cross_layer_cache_one_descriptor_per_run(harness: Harness) -> None:
    lay = attention(layers=8, cross_layer=True)
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": list(range(10, 30))}, {"kv": list(range(40, 60))}, salt=7)
    assert res.descriptors == 1  # every layer of every block: one span on both sides


async def test_quantized_fp8_and_block_size_change(harness: Harness) -> None:
    p = KVCacheLayout.quantized(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=4, head_size=64)
    d = KVCacheLayout.quantized(num_layers=2, num_blocks=64, block_size=32, num_kv_heads=4, head_size=64)
    ps, pw, _ds, dw = await harness.deployment({"kv": p}, {"kv": d})
    await transfer(pw, ps, dw, "r1", {"kv": [3, 4, 9, 10, 20, 21]}, {"kv": [7, 2, 30]}, salt=8)


async def test_library_mode_and_many_requests_in_flight(harness: Harness) -> None:
    lay = attention(blocks=128)
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw = await harness.worker(p, {"kv": lay}, library=True)
    dw = await harness.worker(d, {"kv": lay}, library=True)
    rng = np.random.default_rng(0)
    p_ids, d_ids = rng.permutation(128), rng.permutation(128)
    for i in range(8):
        await pw.prefill(f"r{i}", {"kv": p_ids[i * 16 : (i + 1) * 16]}, salt=100 + i)
    for i in range(8):
        dw.poison({"kv": d_ids[i * 16 : (i + 1) * 16]})
    pulls = [dw.client.pull(f"r{i}", [p.peer_address], {"kv": d_ids[i * 16 : (i + 1) * 16]}) for i in range(8)]
    await asyncio.gather(*pulls)
    for i in range(8):
        assert dw.verify({"kv": d_ids[i * 16 : (i + 1) * 16]}, 100 + i) == (16 * lay.page_bytes * 4, 0)


async def test_completion_stream_and_non_waiting_pull(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    released = asyncio.ensure_future(_first_event(pw[0], "RELEASED"))
    pulled = asyncio.ensure_future(_first_event(dw[0], "PULLED"))
    await asyncio.sleep(0.05)  # both streams are open
    await pw[0].prefill("r1", {"kv": [1, 2, 3]}, salt=9)
    dw[0].poison({"kv": [4, 5, 6]})
    res = await dw[0].client.pull("r1", [ps[0].peer_address], {"kv": [4, 5, 6]}, wait=False)
    assert res.transfer_id
    ev = await asyncio.wait_for(pulled, 10)
    assert (ev.request_id, ev.transfer_id, ev.bytes) == ("r1", res.transfer_id, 3 * lay.page_bytes * 4)
    assert dw[0].verify({"kv": [4, 5, 6]}, 9)[1] == 0
    rel = await asyncio.wait_for(released, 10)
    assert rel.peer == "decode"
    # A late watcher can replay what it missed.
    seen = []
    async for e in dw[0].client.watch_completions(replay=True):
        seen.append(e.kind)
        break
    assert seen == ["PULLED"]


async def _first_event(worker: object, kind: str) -> object:
    async for ev in worker.client.watch_completions():  # type: ignore[attr-defined]
        if ev.kind == kind:
            return ev
    raise AssertionError("stream ended")


async def test_mooncake_backend_hetero_tp(harness: Harness) -> None:
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": attention(tp=2)}, {"kv": attention(tp=1)}, prefill_tp=2, decode_tp=1, backend="mooncake"
    )
    assert ps[0].core is not None
    assert ps[0].core.dp.backend == "mooncake"
    (res,) = await transfer(pw, ps, dw, "m1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=11)
    assert res.remote_ranks == (0, 1)


async def test_release_drops_a_publish_and_later_pulls_find_nothing(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("gone", {"kv": [1, 2]}, salt=1)
    await pw[0].prefill("kept", {"kv": [3, 4]}, salt=2)
    assert (await pw[0].client.status())["leases"] == 2
    assert await pw[0].client.release("gone") is True
    assert await pw[0].client.release("gone") is False  # nothing held any more
    assert (await pw[0].client.status())["leases"] == 1
    with pytest.raises(KvxferRpcError) as info:
        await dw[0].pull("gone", ps, {"kv": [5, 6]})
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    res = await dw[0].pull("kept", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 2) == (res.bytes, 0)
