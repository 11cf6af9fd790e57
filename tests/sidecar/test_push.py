"""Push mode end to end (real gRPC servers, real NIXL on loopback): the prefill side WRITEs, every byte checked.

Faults use the named fault injector :class:`~tests.sidecar.helpers.DelayedDataPlane` on the
writer: it holds each WRITE before posting it, so "abort while a WRITE is in flight" happens on cue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import grpc
import numpy as np
import pytest

from kvxfer.client import TokenSpan
from kvxfer.layout import KVCacheLayout
from kvxfer.server.app import Sidecar
from kvxfer.wire import common_pb2, local_pb2, peer_pb2, peer_pb2_grpc
from tests.sidecar.helpers import (
    DelayedDataPlane,
    Harness,
    Worker,
    attention,
    expect_error,
    gone_worker_released,
    push_transfer,
)

FRAGMENTED_P = [5, 6, 7, 1, 30, 31, 12, 40, 41, 42, 43, 2]
FRAGMENTED_D = [9, 3, 4, 50, 51, 52, 20, 21, 0, 60, 61, 62]
OK = grpc.StatusCode
LAY = attention()


def _count(sidecar: Sidecar, direction: str, outcome: str) -> float:
    assert sidecar.metrics is not None
    return float(sidecar.metrics.transfers.labels(direction=direction, outcome=outcome)._value.get())


@pytest.mark.parametrize("offer_first", [True, False])
async def test_push_writes_every_byte(harness: Harness, offer_first: bool) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    (res,) = await push_transfer(pw, ps, dw, "r1", {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}, salt=11,
                                 offer_first=offer_first)  # fmt: skip
    assert res.done
    assert res.bytes == len(FRAGMENTED_D) * LAY.page_bytes * LAY.num_layers
    assert res.descriptors == 9 * LAY.num_layers  # the pull's coalescing: 9 runs per layer
    assert res.remote_ranks == (0,)
    # WRITEs on the prefill side, no READ on the decode side.
    assert _count(ps[0], "write", "ok") == 1
    assert _count(ds[0], "push", "ok") == 1
    assert _count(ds[0], "read", "ok") == 0
    await _wait_leases(pw, 0)  # the writer freed its publish itself once its WRITE landed


MLA = KVCacheLayout.mla(num_layers=3, num_blocks=64, block_size=16, latent_dim=576)
HYBRID = {"attention": attention(layers=3), "mamba": KVCacheLayout.mamba(num_layers=1, num_blocks=64,
                                                                          page_size_bytes=4000)}  # fmt: skip


def _split(tp: int) -> dict[str, KVCacheLayout]:
    """A hybrid rank of ``tp``: its heads, and its slice of each segment of a Mamba2 state (x, B, C, SSM)."""
    local = tuple(s // tp for s in (384, 96, 96, 1024))
    mamba = KVCacheLayout.mamba(num_layers=2, num_blocks=64, page_size_bytes=sum(local), segments=local)
    return {"attention": attention(layers=2, tp=tp), "mamba": mamba}


FP8_16 = KVCacheLayout.quantized(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=4, head_size=64)
FP8_32 = KVCacheLayout.quantized(num_layers=2, num_blocks=64, block_size=32, num_kv_heads=4, head_size=64)
CASES: dict[str, tuple[object, object, int, int, dict[str, list[int]], dict[str, list[int]]]] = {
    "tp2-to-1-hnd": ({"kv": attention(tp=2)}, {"kv": attention(tp=1)}, 2, 1, {"kv": FRAGMENTED_P},
                     {"kv": FRAGMENTED_D}),
    "tp1-to-2-nhd": ({"kv": attention(tp=1, order="NHD")}, {"kv": attention(tp=2, order="NHD")}, 1, 2,
                     {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}),
    "tp2-to-4-replicated": ({"kv": attention(heads=2, tp=2)}, {"kv": attention(heads=2, tp=2)}, 2, 4,
                            {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}),
    "mla-tp2-to-1": ({"kv": MLA}, {"kv": MLA}, 2, 1, {"kv": FRAGMENTED_P}, {"kv": FRAGMENTED_D}),
    "hybrid-mamba": (HYBRID, HYBRID, 1, 1, {"attention": FRAGMENTED_P, "mamba": [7, 8]},
                     {"attention": FRAGMENTED_D, "mamba": [33, 1]}),
    "mamba-split-tp2-to-1": (_split(2), _split(1), 2, 1, {"attention": FRAGMENTED_P, "mamba": [7, 8]},
                             {"attention": FRAGMENTED_D, "mamba": [33, 1]}),
    "mamba-split-tp1-to-4": (_split(1), _split(4), 1, 4, {"attention": FRAGMENTED_P, "mamba": [7, 8]},
                             {"attention": FRAGMENTED_D, "mamba": [33, 1]}),
    "cross-layer": ({"kv": attention(layers=8, cross_layer=True)}, {"kv": attention(layers=8, cross_layer=True)}, 1,
                    1, {"kv": list(range(10, 30))}, {"kv": list(range(40, 60))}),
    "fp8-block-16-to-32": ({"kv": FP8_16}, {"kv": FP8_32}, 1, 1, {"kv": [3, 4, 9, 10, 20, 21]}, {"kv": [7, 2, 30]}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
async def test_push_every_cache_kind_and_tp_pair(harness: Harness, case: str) -> None:
    p_lay, d_lay, p_tp, d_tp, p_blocks, d_blocks = CASES[case]
    if case == "tp2-to-4-replicated":  # 2 heads over 4 decode ranks: each head is on two decode ranks
        d_lay = {"kv": KVCacheLayout.attention(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=1,
                                               total_kv_heads=2, head_size=64)}  # fmt: skip
    ps, pw, _ds, dw = await harness.deployment(p_lay, d_lay, prefill_tp=p_tp, decode_tp=d_tp)  # type: ignore[arg-type]
    results = await push_transfer(pw, ps, dw, case, p_blocks, d_blocks, salt=3)
    layouts: Mapping[str, KVCacheLayout] = dw[0].layouts
    want = sum(len(ids) * layouts[g].page_bytes * layouts[g].num_layers for g, ids in d_blocks.items())
    assert all(r.bytes == want for r in results), [r.bytes for r in results]  # every receiving byte written once
    written = sum(_bytes(s, "write") for s in ps)
    assert written == want * d_tp
    await _wait_leases(pw, 0)  # every prefill rank freed, the unread MLA replica by its UNREAD notice


async def _wait_leases(workers: list[Worker] | Worker, n: int, within: float = 5.0) -> None:
    ws = workers if isinstance(workers, list) else [workers]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        leases = [(await w.client.status())["leases"] for w in ws]
        if all(n_ == n for n_ in leases):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"leases never reached {n}")


def _bytes(sidecar: Sidecar, direction: str) -> float:
    assert sidecar.metrics is not None
    return float(sidecar.metrics.transfer_bytes.labels(direction=direction, backend="nixl")._value.get())


# ---------------------------------------------------------------------- faults
async def _pair(harness: Harness, delay: float = 0.0, **settings: object) -> tuple[Sidecar, Worker, Sidecar, Worker,
                                                                                   DelayedDataPlane]:  # fmt: skip
    dp = DelayedDataPlane("prefill-delayed", delay)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp, **settings)
    d = await harness.sidecar(role="decode", engine_id="decode", **settings)
    return p, await harness.worker(p, {"kv": LAY}), d, await harness.worker(d, {"kv": LAY}), dp


async def test_abort_mid_write_is_fenced_no_byte_lands_after(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=1.0)
    dw.poison({"kv": [4, 5, 6]})
    pw.fill({"kv": [1, 2, 3]}, 5)
    pull = asyncio.ensure_future(dw.client.pull("a1", [p.peer_address], {"kv": [4, 5, 6]}, push=True))
    await asyncio.sleep(0.2)
    await pw.client.publish("a1", {"kv": [1, 2, 3]})
    await asyncio.wait_for(dp.reading.wait(), 5)  # the WRITE is in the data plane's hands
    t0 = time.monotonic()
    assert await dw.client.abort("a1", "user cancelled") == (1, False)
    await expect_error(OK.ABORTED, pull, "pull of 'a1' aborted: user cancelled")
    assert time.monotonic() - t0 < 1.0  # the Revoke cancelled the WRITE: no waiting out its deadline
    await asyncio.sleep(1.3)  # past the moment the held WRITE would have been posted
    assert dw.verify({"kv": [4, 5, 6]}, 5)[0] > 0
    poisoned = np.array(dw.buffers["kv"].pages(0)[[4, 5, 6]])
    dw.poison({"kv": [4, 5, 6]})
    assert np.array_equal(poisoned, np.array(dw.buffers["kv"].pages(0)[[4, 5, 6]]))  # still the poison: nothing landed
    assert len(p.core.pusher) == 0 if p.core else False
    await _wait_leases(pw, 0)  # the prefill dropped its publish (the abort reached it)
    dp.delay = 0.0
    (res,) = await push_transfer([pw], [p], [dw], "after", {"kv": [9, 10]}, {"kv": [20, 21]}, salt=6)
    assert res.done


async def test_not_published_in_time_the_offer_is_revoked_and_a_late_publish_freed(harness: Harness) -> None:
    p, pw, _d, dw, _dp = await _pair(harness)
    t0 = time.monotonic()
    await expect_error(OK.DEADLINE_EXCEEDED, dw.client.pull("never", [p.peer_address], {"kv": [1, 2]}, push=True,
                                                             deadline=0.5), "did not finish within")  # fmt: skip
    assert time.monotonic() - t0 < 2.0
    assert p.core is not None
    assert len(p.core.pusher) == 0  # revoked by the fence
    # The prefill finishes later: nobody wants it any more, so its publish is freed at once.
    await pw.client.publish("never", {"kv": [3, 4]})
    released = asyncio.ensure_future(_first_kind(pw, "RELEASED", "never"))
    ev = await asyncio.wait_for(released, 5)
    assert ev.request_id == "never"  # type: ignore[attr-defined]
    assert "gave up on it before it was published" in ev.message  # type: ignore[attr-defined]
    await _wait_leases(pw, 0, within=1.0)


@pytest.mark.parametrize(("deadline", "says"), [(10.0, "before the offer's deadline"), (0.7, "within 0.7")])
async def test_an_offer_lapsing_mid_layer_write_answers_only_once_the_write_landed(harness: Harness, deadline: float,
                                                                                   says: str) -> None:  # fmt: skip
    """The writer's offer lapses (its --transfer-timeout-seconds is below the reader's deadline) while a layer
    WRITE is in the data plane, and that WRITE cannot be recalled (FAULT INJECTOR: it drains, as queued device
    copies do). The reader hears of the failure (deadline 10 s), or has its Revoke answered (deadline 0.7 s:
    it gives up itself while the WRITE drains), only after the WRITE landed: no byte lands in blocks it
    already gave back."""
    dp = DelayedDataPlane("prefill-draining", 1.0, drain=True)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp, transfer_timeout_seconds=0.5)
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    p_blocks, d_blocks, ntok = [1, 2, 3], [4, 5, 6], 3 * LAY.block_size
    pw.fill({"kv": p_blocks}, 9)
    spans = {"kv": TokenSpan(ntok - 1, 0, 0)}
    pull = asyncio.ensure_future(dw.client.pull("lap", [p.peer_address], {"kv": d_blocks}, push=True,
                                                deadline=deadline, spans=spans))  # fmt: skip
    await _offered(p, "lap")
    req = local_pb2.StreamedRequest(request_id="lap", blocks=[common_pb2.BlockList(group="kv", block_ids=p_blocks)],
                                    start_token=0, end_token=ntok)  # fmt: skip
    assert await pw.client.stream_step(1, [req]) == 1
    assert await pw.client.layer_done(1, "kv", 0) == 1
    await asyncio.wait_for(dp.reading.wait(), 5)  # layer 0's WRITE is in the data plane's hands
    await expect_error(OK.DEADLINE_EXCEEDED, pull, says)
    failed_at = time.monotonic()
    assert dp.landed_at, "the layer WRITE never ended"
    assert max(dp.landed_at) <= failed_at
    assert not len(p.core.pusher)  # type: ignore[union-attr]


async def test_publish_aborted_before_the_write_fails_the_push(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=1.0)
    pull = asyncio.ensure_future(dw.client.pull("gone", [p.peer_address], {"kv": [4, 5]}, push=True))
    await asyncio.sleep(0.2)
    await pw.client.publish("gone", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    await pw.client.abort("gone", "prefill cancelled")
    err = await expect_error(OK.ABORTED, pull, "prefill cancelled")
    assert err.reason == "ABORTED"


async def test_writer_stopping_mid_push_tells_the_reader_at_once(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=5.0)
    pull = asyncio.ensure_future(dw.client.pull("w1", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=10.0))
    await asyncio.sleep(0.2)
    await pw.client.publish("w1", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    t0 = time.monotonic()
    await p.stop(0)  # its WRITE is cancelled, and the reader told before the peer API closes
    err = await expect_error(OK.ABORTED, pull, "the sidecar is stopping")
    assert err.reason == "ABORTED"
    assert time.monotonic() - t0 < 3.0


async def test_writer_stopping_before_the_publish_tells_the_reader_at_once(harness: Harness) -> None:
    """An offer still waiting for its publish when the writer's sidecar stops: the reader hears ABORTED then,
    not at its deadline."""
    p, _pw, _d, dw, _dp = await _pair(harness)
    pull = asyncio.ensure_future(dw.client.pull("w0", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=20.0))
    await _offered(p, "w0")
    t0 = time.monotonic()
    await p.stop(0)
    err = await expect_error(OK.ABORTED, pull, "the sidecar is stopping")
    assert err.reason == "ABORTED"
    assert time.monotonic() - t0 < 3.0


async def test_a_push_whose_publish_is_dropped_before_its_task_runs_tells_the_reader_at_once(harness: Harness) -> None:
    """Published and dropped in one loop turn: the push task is cancelled before its first step, so none of
    its own code runs; the reader must still hear ABORTED with the drop's reason, not at its deadline."""
    from kvxfer.wire.convert import blocks_to_proto

    p, _pw, _d, dw, _dp = await _pair(harness)
    pull = asyncio.ensure_future(dw.client.pull("w1", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=20.0))
    await _offered(p, "w1")
    core = p.core
    assert core is not None
    t0 = time.monotonic()
    core.publisher.publish(local_pb2.PublishRequest(request_id="w1", blocks=blocks_to_proto({"kv": [1, 2]})))
    core.pusher.published("w1")  # the offer's push task is created...
    assert core.publisher.abort("w1", "dropped in the same turn")  # ...and cancelled before it ever runs
    await expect_error(OK.ABORTED, pull, "dropped in the same turn")
    assert time.monotonic() - t0 < 3.0
    assert len(core.pusher) == 0


# ---------------------------------------------------------------------- trust
async def test_offers_are_checked_and_bound(harness: Harness) -> None:
    p, pw, d, dw, _dp = await _pair(harness)
    other = await harness.sidecar(role="decode", engine_id="other")
    ow = await harness.worker(other, {"kv": LAY})
    await pw.client.publish("mine", {"kv": [1, 2]}, reader_engine_id="decode")
    # Another engine may not be written the publish bound to "decode".
    await expect_error(OK.PERMISSION_DENIED, ow.client.pull("mine", [p.peer_address], {"kv": [3, 4]}, push=True),
                       "bound to reader engine 'decode'")  # fmt: skip
    # Offered ids out of the reader's layout: refused naming the field, nothing kept.
    await expect_error(OK.INVALID_ARGUMENT, dw.client.pull("bad", [p.peer_address], {"kv": [1, 999]}, push=True),
                       "local_blocks[kv]", "999")  # fmt: skip
    assert p.core is not None
    assert len(p.core.pusher) == 0
    async with grpc.aio.insecure_channel(p.peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # never handshaken: refused
            await stub.Offer(peer_pb2.OfferRequest(request_id="x", engine_id="stranger", instance_id="i", epoch=1,
                                                   rank=common_pb2.Rank(tp_rank=0, tp_size=1, pp_size=1),
                                                   blocks=[common_pb2.BlockList(group="kv", block_ids=[1])]),
                             timeout=5)  # fmt: skip
        assert exc.value.code() == OK.FAILED_PRECONDITION
        assert "has not handshaken" in (exc.value.details() or "")
    # A Landed from someone who is not the writer offered to completes nothing.
    pull = asyncio.ensure_future(dw.client.pull("mine", [p.peer_address], {"kv": [3, 4]}, push=True, deadline=3))
    await asyncio.sleep(0.3)
    async with grpc.aio.insecure_channel(d.peer_address) as ch:
        resp = await peer_pb2_grpc.PeerStub(ch).Landed(
            peer_pb2.LandedRequest(request_id="mine", engine_id="impostor", instance_id="i", epoch=1,
                                   rank=common_pb2.Rank(tp_rank=0, tp_size=1, pp_size=1), bytes=1),
            timeout=5,
        )  # fmt: skip
        assert not resp.found
    assert (await pull).done  # the real writer's WRITE (it was published before the offer)


# ---------------------------------------------------------------------- layer-wise
async def test_layerwise_push_lands_each_layer_before_the_publish(harness: Harness) -> None:
    """StreamStep + LayerDone: each layer of each step is written as it is announced; once every offered byte
    landed the reader is told, before the publish; the publish then adds nothing and is freed at once."""
    lay = attention(layers=4, block_size=16)
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    p_blocks, d_blocks = [5, 6, 7, 1, 30], [9, 3, 4, 50, 51]
    prompt, loaded = 74, 73  # the decode side loads all but the last prompt token
    pw[0].fill({"kv": p_blocks}, 21)
    dw[0].poison({"kv": d_blocks})
    pull = asyncio.ensure_future(dw[0].client.pull("lw", [ps[0].peer_address], {"kv": d_blocks}, push=True,
                                                   spans={"kv": TokenSpan(loaded, 0, 0)}))  # fmt: skip
    await _offered(ps[0], "lw")
    src, dst = pw[0].buffers["kv"], dw[0].buffers["kv"]
    steps = [(1, 0, 40), (2, 40, prompt)]
    for step, start, end in steps:
        table = p_blocks[: -(-end // lay.block_size)]
        req = local_pb2.StreamedRequest(request_id="lw", blocks=[common_pb2.BlockList(group="kv", block_ids=table)],
                                        start_token=start, end_token=end)  # fmt: skip
        assert await pw[0].client.stream_step(step, [req]) == 1
        for layer in range(lay.num_layers):
            assert await pw[0].client.layer_done(step, "kv", layer) == 1
    # Every layer landed before the request was even published.
    for layer in range(lay.num_layers):
        await _until(lambda layer=layer: np.array_equal(np.asarray(dst.pages(layer)[d_blocks]),
                                                        np.asarray(src.pages(layer)[p_blocks])))  # fmt: skip
    # Every offered byte landed: the decode side is told at once, before the prefill even published.
    res = await asyncio.wait_for(pull, 5)
    assert (await pw[0].client.status())["leases"] == 0
    # Five blocks, and the block step 1 left partly computed (tokens 32..39 of 32..47) written again by step 2.
    assert res.bytes == (5 + 1) * lay.page_bytes * lay.num_layers
    # The publish comes later: the reader already has everything, so it is freed at once, nothing written.
    await pw[0].client.publish("lw", {"kv": p_blocks})
    await _wait_leases(pw, 0, within=2.0)
    assert _bytes(ps[0], "write") == res.bytes


async def test_layerwise_offer_after_the_first_layers_is_completed_at_the_publish(harness: Harness) -> None:
    """Layers announced before the offer came are not streamed; the publish writes what the stream missed."""
    lay = attention(layers=3, block_size=16)
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    p_blocks, d_blocks = [5, 6, 7], [9, 3, 4]
    pw[0].fill({"kv": p_blocks}, 22)
    dw[0].poison({"kv": d_blocks})
    req = local_pb2.StreamedRequest(request_id="late", blocks=[common_pb2.BlockList(group="kv", block_ids=p_blocks)],
                                    start_token=0, end_token=48)  # fmt: skip
    assert await pw[0].client.stream_step(7, [req]) == 0  # no offer yet
    assert await pw[0].client.layer_done(7, "kv", 0) == 0
    pull = asyncio.ensure_future(dw[0].client.pull("late", [ps[0].peer_address], {"kv": d_blocks}, push=True,
                                                   spans={"kv": TokenSpan(47, 0, 0)}))  # fmt: skip
    await _offered(ps[0], "late")
    for layer in (1, 2):
        assert await pw[0].client.layer_done(7, "kv", layer) == 1
    await pw[0].client.publish("late", {"kv": p_blocks})
    res = await pull
    assert dw[0].verify({"kv": d_blocks}, 22)[1] == 0
    assert (
        res.bytes == 3 * lay.page_bytes * 2 + 3 * lay.page_bytes * 3
    )  # layers 1-2 streamed, then all 3 at the publish


async def test_layerwise_push_streams_only_into_the_offers_of_the_publishs_reader(harness: Harness) -> None:
    """Engine "other" offers for the request before it is published; the prefill worker streams it for engine
    "decode" (the proxy's kvxfer_reader_engine_id). None of its layers is written into "other"'s blocks, and
    the publish, bound to "decode", refuses its offer. It used to receive every layer and finish as moved."""
    p, pw, _d, _dw, _dp = await _pair(harness)
    other = await harness.sidecar(role="decode", engine_id="other")
    ow = await harness.worker(other, {"kv": LAY})
    pw.fill({"kv": [1, 2]}, 31)
    ow.poison({"kv": [3, 4]})
    before = [np.asarray(ow.buffers["kv"].pages(k)[[3, 4]]).copy() for k in range(LAY.num_layers)]
    pull = asyncio.ensure_future(ow.client.pull("bound", [p.peer_address], {"kv": [3, 4]}, push=True, deadline=5))
    await _offered(p, "bound")
    req = local_pb2.StreamedRequest(request_id="bound", blocks=[common_pb2.BlockList(group="kv", block_ids=[1, 2])],
                                    start_token=0, end_token=2 * LAY.block_size, reader_engine_id="decode")  # fmt: skip
    assert await pw.client.stream_step(1, [req]) == 0  # an offer, but not the reader's
    for layer in range(LAY.num_layers):
        assert await pw.client.layer_done(1, "kv", layer) == 0
    await pw.client.publish("bound", {"kv": [1, 2]}, reader_engine_id="decode")
    await expect_error(OK.PERMISSION_DENIED, pull, "bound to reader engine 'decode'")
    for k in range(LAY.num_layers):
        assert np.array_equal(np.asarray(ow.buffers["kv"].pages(k)[[3, 4]]), before[k]), f"layer {k} was written"
    assert _bytes(p, "write") == 0
    bad = local_pb2.StreamedRequest(request_id="x", blocks=[common_pb2.BlockList(group="kv", block_ids=[1])],
                                    start_token=0, end_token=1, reader_engine_id="no spaces allowed")  # fmt: skip
    await expect_error(OK.INVALID_ARGUMENT, pw.client.stream_step(2, [bad]), "requests[0].reader_engine_id")


async def test_layer_done_refuses_unknown_groups_and_layers(harness: Harness) -> None:
    _ps, pw, _ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await expect_error(OK.INVALID_ARGUMENT, pw[0].client.layer_done(1, "kv9", 0), "group: unknown cache group 'kv9'")
    await expect_error(OK.INVALID_ARGUMENT, pw[0].client.layer_done(1, "kv", 99), "layer: 99 is not below 4")
    bad = local_pb2.StreamedRequest(request_id="x", blocks=[common_pb2.BlockList(group="kv", block_ids=[1])],
                                    start_token=5, end_token=5)  # fmt: skip
    await expect_error(OK.INVALID_ARGUMENT, pw[0].client.stream_step(1, [bad]), "requests[0].end_token: 5")


async def _until(pred: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def _first_kind(worker: Worker, kind: str, rid: str) -> object:
    # replay: the stream may open after the event (the log keeps it)
    async for ev in worker.client.watch_completions(replay=True):
        if ev.kind == kind and ev.request_id == rid:
            return ev
    raise AssertionError("stream ended")


async def test_layer_events_that_cannot_be_waited_for_leave_the_layers_to_the_publish(harness: Harness) -> None:
    """A StreamStep naming CUDA events on a host without CUDA: no layer is written before its event could be
    waited for; the stream gives up and the publish writes the whole request (every byte right)."""
    lay = attention(layers=2, block_size=16)
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    p_blocks, d_blocks = [5, 6], [9, 3]
    pw[0].fill({"kv": p_blocks}, 23)
    dw[0].poison({"kv": d_blocks})
    pull = asyncio.ensure_future(dw[0].client.pull("ev", [ps[0].peer_address], {"kv": d_blocks}, push=True,
                                                   spans={"kv": TokenSpan(31, 0, 0)}))  # fmt: skip
    await _offered(ps[0], "ev")
    req = local_pb2.StreamedRequest(request_id="ev", blocks=[common_pb2.BlockList(group="kv", block_ids=p_blocks)],
                                    start_token=0, end_token=32)  # fmt: skip
    events = [local_pb2.LayerEvent(group="kv", layer=n, ipc_handle=bytes(64), device=0) for n in range(2)]
    assert await pw[0].client.stream_step(1, [req], events) == 1
    for layer in range(2):
        assert await pw[0].client.layer_done(1, "kv", layer) == 1
    await asyncio.sleep(0.3)
    assert not pull.done()
    assert all(np.all(np.asarray(dw[0].buffers["kv"].pages(n)[d_blocks]) == 0xA5) for n in range(2))  # untouched
    await pw[0].client.publish("ev", {"kv": p_blocks})
    res = await pull
    assert dw[0].verify({"kv": d_blocks}, 23)[1] == 0
    assert res.bytes == 2 * lay.page_bytes * 2  # written once, at the publish


async def _offered(writer: Sidecar, rid: str, within: float = 5.0) -> None:
    """Until the writer holds an offer for ``rid`` (the reader's Offer call arrived)."""
    deadline = time.monotonic() + within
    while writer.core is None or not writer.core.pusher.offers.get(rid):
        assert time.monotonic() < deadline, f"no offer for {rid!r} reached the writer"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- unfenced WRITEs
async def _unfenced_pair(harness: Harness) -> tuple[Sidecar, Worker, Sidecar, Worker, DelayedDataPlane]:
    """The writer's WRITEs stay in flight past the fence budget when cancelled (the fault injector's
    ``unfenced``: as the real data plane's do when the reader's peer is stalled)."""
    dp = DelayedDataPlane("prefill-unfenced", 30.0, unfenced=True, fence_seconds=0.3)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp)
    d = await harness.sidecar(role="decode", engine_id="decode")
    return p, await harness.worker(p, {"kv": LAY}), d, await harness.worker(d, {"kv": LAY}), dp


async def test_a_revoke_whose_write_was_cancelled_unfenced_fails_the_push_unfenced(harness: Harness) -> None:
    """The reader aborts its push; the writer's Revoke cancels a WRITE that stays in flight past the fence
    budget. The Revoke's answer says so, and the reader's pull fails with reason DATA_PLANE_UNFENCED (it
    was answered as usual, reason ABORTED: the worker would reuse blocks the WRITE can still land in)."""
    p, pw, _d, dw, dp = await _unfenced_pair(harness)
    pull = asyncio.ensure_future(dw.client.pull("u1", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=20.0))
    await _offered(p, "u1")
    await pw.client.publish("u1", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    await dw.client.abort("u1", "user cancelled")
    err = await expect_error(OK.ABORTED, pull, "may still land")
    assert err.reason == "DATA_PLANE_UNFENCED"
    assert p.metrics is not None
    assert p.metrics.unfenced.labels(op="write")._value.get() == 1


async def test_a_push_whose_publish_is_dropped_mid_write_unfenced_fails_unfenced(harness: Harness) -> None:
    """The writer's publish is dropped while its WRITE is held; the cancelled WRITE ends unfenced: the reader
    hears DATA_PLANE_UNFENCED (it heard ABORTED)."""
    p, pw, _d, dw, dp = await _unfenced_pair(harness)
    pull = asyncio.ensure_future(dw.client.pull("u2", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=20.0))
    await _offered(p, "u2")
    await pw.client.publish("u2", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    await pw.client.abort("u2", "prefill cancelled")
    err = await expect_error(OK.ABORTED, pull, "may still land")
    assert err.reason == "DATA_PLANE_UNFENCED"


async def test_a_push_whose_offer_deadline_cancels_its_write_unfenced_fails_unfenced(harness: Harness) -> None:
    """The offer's deadline cancels a WRITE that ends unfenced: the reader hears DATA_PLANE_UNFENCED, not DEADLINE."""
    p, pw, _d, dw, _dp = await _unfenced_pair(harness)
    pull = asyncio.ensure_future(dw.client.pull("u3", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=1.5))
    await _offered(p, "u3")
    await pw.client.publish("u3", {"kv": [1, 2]})
    err = await expect_error(OK.DEADLINE_EXCEEDED, pull, "may still land")
    assert err.reason == "DATA_PLANE_UNFENCED"


async def test_a_revoke_waits_out_the_writers_fence_budget(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Revoke is answered once the cancelled WRITE was fenced, up to the writer's --fence-budget-seconds:
    the reader's Revoke call must wait that long beyond its usual cap (PEER_CALL_SECONDS, shortened here to
    1 s below the 2 s fence instead of 10 s below a fence budget above it). It gave up at the cap, took the
    writer for unreachable and reported the pull without hearing that the WRITE may still land."""
    monkeypatch.setattr("kvxfer.server.push_steps.PEER_CALL_SECONDS", 1.0)
    dp = DelayedDataPlane("prefill-unfenced", 30.0, unfenced=True, fence_seconds=2.0)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp, fence_budget_seconds=2.0)
    d = await harness.sidecar(role="decode", engine_id="decode", fence_budget_seconds=2.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    pull = asyncio.ensure_future(dw.client.pull("u4", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=3.0))
    await _offered(p, "u4")
    await pw.client.publish("u4", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    await dw.client.abort("u4", "user cancelled")
    err = await expect_error(OK.ABORTED, pull, "may still land")
    assert err.reason == "DATA_PLANE_UNFENCED"


async def test_a_gone_writers_memory_is_released_only_once_its_writes_were_fenced(harness: Harness) -> None:
    """The prefill worker exits while a WRITE from its blocks is in flight and its fence takes 1 s: its memory
    is deregistered and unmapped only once the WRITE's transfer returned. It went at once (the push tasks its
    publishes' drop cancelled were not waited for), while the WRITE could still read from it."""
    dp = DelayedDataPlane("prefill-gone", 30.0, unfenced=True, fence_seconds=1.0)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp, fence_budget_seconds=2.0)
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    pull = asyncio.ensure_future(dw.client.pull("g1", [p.peer_address], {"kv": [4, 5]}, push=True, deadline=20.0))
    await _offered(p, "g1")
    await pw.client.publish("g1", {"kv": [1, 2]})
    await asyncio.wait_for(dp.reading.wait(), 5)
    at_deregister = await gone_worker_released(p, dp)
    assert at_deregister == [0] * len(at_deregister), "released while a WRITE from it was in flight"
    await expect_error(OK.ABORTED, pull, "may still land")


async def test_a_push_written_whole_after_a_layer_write_failed_unfenced_is_not_reported_moved(
    harness: Harness,
) -> None:
    """A layer's WRITE fails while still in flight past the fence budget; the publish then writes the whole
    offer, which succeeds. The reader must not hear that its blocks were filled: the failed layer WRITE may
    still land after it put them to use (it did hear success). Its pull fails with DATA_PLANE_UNFENCED."""
    lay = attention(layers=2, block_size=16)
    dp = DelayedDataPlane("prefill-layer", 0.0, fail_first=0.0, unfenced_first=True)  # FAULT INJECTOR (helpers)
    p = await harness.sidecar(role="prefill", engine_id="prefill", data_plane=dp)
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw, dw = await harness.worker(p, {"kv": lay}), await harness.worker(d, {"kv": lay})
    p_blocks, d_blocks = [5, 6], [9, 3]
    pull = asyncio.ensure_future(dw.client.pull("lw-u", [p.peer_address], {"kv": d_blocks}, push=True,
                                                spans={"kv": TokenSpan(31, 0, 0)}, deadline=20.0))  # fmt: skip
    await _offered(p, "lw-u")
    req = local_pb2.StreamedRequest(request_id="lw-u", blocks=[common_pb2.BlockList(group="kv", block_ids=p_blocks)],
                                    start_token=0, end_token=32)  # fmt: skip
    assert await pw.client.stream_step(1, [req]) == 1
    assert await pw.client.layer_done(1, "kv", 0) == 1
    await _until(lambda: bool(dp.unfenced_ops))  # the layer WRITE failed unfenced
    await pw.client.publish("lw-u", {"kv": p_blocks})
    err = await expect_error(OK.UNAVAILABLE, pull, "written, but a layer WRITE of it that failed earlier",
                             "may still land")  # fmt: skip
    assert err.reason == "DATA_PLANE_UNFENCED"
    assert (await dw.client.status(unsettled=["lw-u"]))["unsettled"] == ["lw-u"]  # no one can watch a WRITE
