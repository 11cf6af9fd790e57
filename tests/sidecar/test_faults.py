"""Faults: each asserts the status code, the message, and that other transfers still move exact bytes."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from kvxfer.client import AsyncClient, KvxferRpcError
from kvxfer.errors import Reason
from kvxfer.harness.cluster import LocalCluster
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import CudaIpcRef, LibraryRef, SharedMemoryRef, ShmRegionRef
from kvxfer.server.app import Sidecar
from kvxfer.wire import common_pb2, local_pb2, local_pb2_grpc
from kvxfer.wire.convert import layout_to_proto
from tests.sidecar.conftest import JsonLogs
from tests.sidecar.helpers import (
    DelayedDataPlane,
    Harness,
    Worker,
    attention,
    expect_error,
    gone_worker_released,
    peer_lookups,
    transfer,
)

LAY = attention()
OK = grpc.StatusCode


async def _pair(harness: Harness, *, delay: float | None = None, **settings: object) -> tuple[
    Sidecar, Worker, Sidecar, Worker, DelayedDataPlane | None
]:  # fmt: skip
    p = await harness.sidecar(role="prefill", engine_id="prefill", **settings)
    dp = DelayedDataPlane("decode-delayed", delay) if delay is not None else None
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, **settings)
    return p, await harness.worker(p, {"kv": LAY}), d, await harness.worker(d, {"kv": LAY}), dp


async def _still_works(pw: Worker, p: Sidecar, dw: Worker, rid: str = "other", salt: int = 77) -> None:
    """Another transfer through the same sidecars moves every byte right."""
    await transfer([pw], [p], [dw], rid, {"kv": [40, 41, 7]}, {"kv": [50, 2, 3]}, salt=salt)


async def _wait(pred: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_unknown_request_fails_fast_with_not_found(harness: Harness) -> None:
    p, pw, _d, dw, _ = await _pair(harness, transfer_timeout_seconds=30)
    await _still_works(pw, p, dw, rid="warm")  # the handshake is done: what follows is one lookup
    t0 = time.monotonic()
    await expect_error(OK.NOT_FOUND, dw.pull("nope", [p], {"kv": [1]}), "'nope' is not published", p.peer_address)
    assert time.monotonic() - t0 < 2.0  # an answer, not the 30 s deadline
    await _still_works(pw, p, dw)


async def test_duplicate_request_ids(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=0.5)
    await pw.prefill("dup", {"kv": [1, 2]}, salt=1)
    await expect_error(OK.ALREADY_EXISTS, pw.prefill("dup", {"kv": [3]}, salt=1), "request_id", "already published")
    first = asyncio.ensure_future(dw.pull("dup", [p], {"kv": [4, 5]}))
    assert dp is not None
    await asyncio.wait_for(dp.reading.wait(), 5)
    await expect_error(OK.ALREADY_EXISTS, dw.client.pull("dup", [p.peer_address], {"kv": [6, 7]}), "already in flight")
    await first
    assert dw.verify({"kv": [4, 5]}, 1) == (2 * LAY.page_bytes * LAY.num_layers, 0)
    await _still_works(pw, p, dw)


async def test_lease_expiry_releases_counts_and_then_not_found(harness: Harness) -> None:
    p, pw, _d, dw, _ = await _pair(harness)
    expired = asyncio.ensure_future(_first_event(pw, "EXPIRED"))
    await asyncio.sleep(0.05)
    await pw.prefill("short", {"kv": [1, 2]}, salt=1, lease=0.3)
    ev = await asyncio.wait_for(expired, 5)
    assert ev.request_id == "short"
    assert "lease of 0.3s expired" in ev.message
    assert (await pw.client.status())["leases"] == 0
    assert p.metrics is not None
    assert p.metrics.lease_expirations._value.get() == 1
    await expect_error(OK.NOT_FOUND, dw.pull("short", [p], {"kv": [1, 2]}), "'short' is not published")
    await _still_works(pw, p, dw)


async def test_abort_from_decode_side_frees_both_sides(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=1.0)
    prefill_aborted = asyncio.ensure_future(_first_event(pw, "ABORTED"))
    await asyncio.sleep(0.05)
    await pw.prefill("a1", {"kv": [1, 2, 3]}, salt=1)
    await pw.prefill("b1", {"kv": [10, 11]}, salt=2)
    pull = asyncio.ensure_future(dw.pull("a1", [p], {"kv": [4, 5, 6]}))
    other = asyncio.ensure_future(dw.pull("b1", [p], {"kv": [20, 21]}))  # in flight beside it
    assert dp is not None
    await asyncio.wait_for(dp.reading.wait(), 5)
    assert await dw.client.abort("a1", "user cancelled") == (1, False)
    await expect_error(OK.ABORTED, pull, "pull of 'a1' aborted: user cancelled")
    ev = await asyncio.wait_for(prefill_aborted, 5)
    assert (ev.request_id, ev.message) == ("a1", "aborted by peer decode: pull of 'a1' aborted: user cancelled")
    assert (await other).done
    assert dw.verify({"kv": [20, 21]}, 2) == (2 * LAY.page_bytes * LAY.num_layers, 0)
    await _wait(lambda: _leases(pw, 0))  # a1 aborted, b1 confirmed
    assert (await dw.client.status())["transfers_in_flight"] == 0
    dp.delay = 0.0
    await _still_works(pw, p, dw)


async def test_abort_from_prefill_side_stops_the_decode_pull(harness: Harness) -> None:
    p, pw, _d, dw, dp = await _pair(harness, delay=1.0)
    decode_aborted = asyncio.ensure_future(_first_event(dw, "ABORTED"))
    await asyncio.sleep(0.05)
    await pw.prefill("a2", {"kv": [1, 2, 3]}, salt=1)
    await pw.prefill("b2", {"kv": [10, 11]}, salt=2)
    pull = asyncio.ensure_future(dw.pull("a2", [p], {"kv": [4, 5, 6]}))
    other = asyncio.ensure_future(dw.pull("b2", [p], {"kv": [20, 21]}))
    assert dp is not None
    await asyncio.wait_for(dp.reading.wait(), 5)
    assert await pw.client.abort("a2", "prefill preempted") == (0, True)
    await expect_error(OK.ABORTED, pull, "pull of 'a2' aborted: aborted by peer prefill: prefill preempted")
    ev = await asyncio.wait_for(decode_aborted, 5)
    assert (ev.request_id, ev.code) == ("a2", OK.ABORTED)
    assert (await other).done
    assert dw.verify({"kv": [20, 21]}, 2) == (2 * LAY.page_bytes * LAY.num_layers, 0)
    await _wait(lambda: _leases(pw, 0))
    await _wait(lambda: _in_flight_zero(dw))
    dp.delay = 0.0
    await _still_works(pw, p, dw)


async def test_peer_killed_mid_transfer_fails_within_deadline_then_rehandshakes(harness: Harness) -> None:
    dp = DelayedDataPlane("decode-killed", 0.5)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    dw = await harness.worker(d, {"kv": LAY})
    # A healthy prefill sidecar in this process: its transfers must not be disturbed.
    healthy = await harness.sidecar(role="prefill", engine_id="healthy")
    hw = await harness.worker(healthy, {"kv": LAY})
    with LocalCluster(workdir=str(harness.sock_dir / "cluster")) as cluster:
        victim = cluster.start_sidecar("victim", "prefill", "prefill")
        vw = Worker(victim.local_socket, {"kv": LAY}, dw.rank)
        harness.workers.append(vw)
        await vw.client.wait_ready(60)
        await vw.register()
        await vw.prefill("k1", {"kv": [1, 2, 3, 4]}, salt=1)
        await hw.prefill("h0", {"kv": [30, 31, 32]}, salt=5)
        pull = asyncio.ensure_future(dw.pull("k1", [victim.peer_address], {"kv": [5, 6, 7, 8]}, deadline=5.0))
        await asyncio.wait_for(dp.reading.wait(), 10)
        beside = asyncio.ensure_future(dw.pull("h0", [healthy], {"kv": [40, 41, 42]}))  # in flight during the kill
        cluster.kill_sidecar(victim)  # SIGKILL while the READ is in flight
        t0 = time.monotonic()
        # UNAVAILABLE (the data plane reports the dead peer) or DEADLINE_EXCEEDED, never a hang.
        with pytest.raises(KvxferRpcError) as info:
            await pull
        exc = info.value
        assert time.monotonic() - t0 < 6.0
        assert exc.code in (OK.UNAVAILABLE, OK.DEADLINE_EXCEEDED), exc
        assert victim.peer_address in exc.details or "did not finish within 5s" in exc.details
        assert (await beside).done
        assert dw.verify({"kv": [40, 41, 42]}, 5) == (3 * LAY.page_bytes * LAY.num_layers, 0)
        dp.delay = 0.0
        # Nothing else was disturbed: the healthy peer still serves with exact bytes.
        await transfer([hw], [healthy], [dw], "h1", {"kv": [9, 10]}, {"kv": [11, 12]}, salt=2)
        # The victim comes back on the same address: the decode side re-handshakes on next use.
        port = int(victim.peer_address.rsplit(":", 1)[1])
        back = cluster.start_sidecar("victim", "prefill", "prefill", port=port)
        await vw.client.close()
        vw.client = AsyncClient(back.local_socket)
        await vw.client.wait_ready(60)
        await vw.register()
        assert d.metrics is not None
        before = d.metrics.handshakes.labels(outcome="ok")._value.get()
        await vw.prefill("k2", {"kv": [1, 2]}, salt=3)
        res = await dw.pull("k2", [back.peer_address], {"kv": [20, 21]})
        assert res.done
        assert dw.verify({"kv": [20, 21]}, 3)[1] == 0
        assert d.metrics.handshakes.labels(outcome="ok")._value.get() == before + 1


async def test_malformed_and_invalid_requests_name_the_field(harness: Harness) -> None:
    p, pw, _d, dw, _ = await _pair(harness)
    channel = grpc.aio.insecure_channel(p.local_target)
    raw = channel.unary_unary("/kvxfer.v1.Local/Publish")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff garbage", timeout=5)
        assert info.value.code() == OK.INVALID_ARGUMENT
        assert "malformed kvxfer.v1.PublishRequest" in (info.value.details() or "")
    finally:
        await channel.close()
    channel = grpc.aio.insecure_channel(p.peer_address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/kvxfer.v1.Peer/Handshake")(b"\x0a\xff\xff\xff", timeout=5)
        assert info.value.code() == OK.INVALID_ARGUMENT
        assert "malformed kvxfer.v1.HandshakeRequest" in (info.value.details() or "")
    finally:
        await channel.close()
    c = pw.client
    await expect_error(OK.INVALID_ARGUMENT, c.publish("", {"kv": [1]}), "request_id: must not be empty")
    await expect_error(OK.INVALID_ARGUMENT, c.publish("x", {"kv": [1, 64]}),
                       "blocks[kv]: block id 64 at position 1 is out of range [0, 64)")  # fmt: skip
    await expect_error(OK.INVALID_ARGUMENT, c.publish("x", {"kv": [3, 3]}), "block id 3 appears more than once")
    await expect_error(OK.INVALID_ARGUMENT, c.publish("x", {"nope": [1]}), "unknown cache group 'nope'")
    await expect_error(OK.INVALID_ARGUMENT, c.publish("x", {"kv": [1]}, lease_seconds=-1), "lease_seconds")
    await pw.prefill("v1", {"kv": [1, 2]}, salt=1)
    await expect_error(OK.INVALID_ARGUMENT, dw.client.pull("v1", [p.peer_address], {"kv": [1, 99]}),
                       "local_blocks[kv]: block id 99 at position 1 is out of range [0, 64)")  # fmt: skip
    three = dw.client.pull("v1", [p.peer_address], {"kv": [1, 2, 3]})
    await expect_error(OK.INVALID_ARGUMENT, three, "length mismatch", "3 local blocks")
    await expect_error(OK.INVALID_ARGUMENT, dw.client.pull("v1", ["not-an-address"], {"kv": [1, 2]}),
                       "remote_addresses[0]")  # fmt: skip
    req = local_pb2.RegisterCachesRequest(groups=[local_pb2.CacheGroup(name="kv", layout=layout_to_proto(LAY))])
    req.groups[0].layout.num_layers = 0
    stub = dw.client._stub
    with pytest.raises(grpc.aio.AioRpcError) as info2:
        await stub.RegisterCaches(req, timeout=5)
    assert info2.value.code() == OK.INVALID_ARGUMENT
    assert "groups[0].layout.num_layers: must be a positive integer, got 0" in (info2.value.details() or "")
    missing = SharedMemoryRef(tuple(ShmRegionRef("missing-seg", 0) for _ in range(4)))
    await expect_error(
        OK.INVALID_ARGUMENT, dw.client.register_caches({"kv": (LAY, missing)}),
        "groups[0].memory.shm.regions[0].name", "'missing-seg'", "does not exist",
    )  # fmt: skip
    await expect_error(OK.INVALID_ARGUMENT, dw.client.register_caches({"kv": (LAY, CudaIpcRef((), ()))}),
                       "groups[0].memory.cuda_ipc.handles: the layout has 4 regions")  # fmt: skip
    await expect_error(OK.INVALID_ARGUMENT,
                       dw.client.register_caches({"kv": (LAY, LibraryRef((1, 2, 3, 4), pid=1))}),
                       "library-mode addresses belong to process 1")  # fmt: skip
    # The failed registrations left the old one in place: transfers still work.
    await _still_works(pw, p, dw)


async def test_oversized_message_is_resource_exhausted(harness: Harness) -> None:
    p, pw, _d, dw, _ = await _pair(harness, max_message_bytes=65536)
    huge = {"kv": np.full(100_000, 1_000_000, dtype=np.int64)}
    await expect_error(OK.RESOURCE_EXHAUSTED, pw.client.publish("big", huge), "65536")
    await _still_works(pw, p, dw)


async def test_token_required_on_local_and_peer_apis(harness: Harness, token_file: object, json_logs: JsonLogs) -> None:
    good = token_file("s3cret-token")  # type: ignore[operator]
    wrong = token_file("other-token", "wrong")  # type: ignore[operator]
    p = await harness.sidecar(role="prefill", engine_id="prefill", token_file=good)
    d = await harness.sidecar(role="decode", engine_id="decode", token_file=good)
    d_wrong = await harness.sidecar(role="decode", engine_id="intruder", token_file=wrong)
    for target in (p, d):
        c = AsyncClient(target.local_target)
        err = await expect_error(OK.UNAUTHENTICATED, c.status(), "missing 'authorization: Bearer <token>'")
        assert "s3cret" not in err.details
        await c.close()
        c = AsyncClient(target.local_target, token="guess")
        err = await expect_error(OK.UNAUTHENTICATED, c.status(), "not valid")
        assert "guess" not in err.details
        assert "s3cret" not in err.details
        await c.close()
    # Health stays open for Kubernetes probes (no metadata).
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(p.peer_address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    pw = await harness.worker(p, {"kv": LAY}, token="s3cret-token")
    dw = await harness.worker(d, {"kv": LAY}, token="s3cret-token")
    iw = await harness.worker(d_wrong, {"kv": LAY}, token="other-token")
    await pw.prefill("t1", {"kv": [1, 2]}, salt=1)
    # A sidecar holding another token is refused by the prefill sidecar's peer API.
    await expect_error(OK.UNAUTHENTICATED, iw.pull("t1", [p], {"kv": [3, 4]}), "not valid")
    res = await dw.pull("t1", [p], {"kv": [3, 4]})
    assert res.done
    assert dw.verify({"kv": [3, 4]}, 1)[1] == 0
    await _still_works(pw, p, dw)
    # Every sidecar logged at debug level meanwhile: the refusals are there, no token ever is.
    refusals = [r for r in json_logs.records() if r["msg"] == "unauthenticated call refused"]
    assert len(refusals) >= 5, json_logs.text[-2000:]
    assert any(r["method"] == "/kvxfer.v1.Peer/Handshake" for r in refusals)
    for secret in ("s3cret-token", "other-token", "guess"):
        assert secret not in json_logs.text


async def test_incompatible_layouts_are_refused_listing_every_difference(harness: Harness) -> None:
    p, pw, _d, dw, _ = await _pair(harness)
    other = KVCacheLayout.attention(num_layers=3, num_blocks=64, block_size=16, num_kv_heads=8, head_size=128,
                                    dtype="fp16")  # fmt: skip
    odd = await harness.sidecar(role="decode", engine_id="odd")
    ow = await harness.worker(odd, {"kv": other})
    await pw.prefill("i1", {"kv": [1, 2]}, salt=1)
    err = await expect_error(OK.FAILED_PRECONDITION, ow.pull("i1", [p], {"kv": [1, 2]}), "incompatible peer")
    for diff in ("dtype: local fp16, remote bf16", "num_layers: local 3, remote 4", "head_size: local 128, remote 64"):
        assert diff in err.details
    assert odd.metrics is not None
    assert odd.metrics.handshakes.labels(outcome="refused")._value.get() == 1
    res = await dw.pull("i1", [p], {"kv": [3, 4]})  # the compatible reader is unaffected
    assert res.done
    assert dw.verify({"kv": [3, 4]}, 1)[1] == 0


async def test_a_read_on_a_grant_that_outlasts_it_is_held_longer_by_a_lookup(harness: Harness) -> None:
    """A grant of 2 s (the publish's own lease) and a READ that takes 2.5 s: a second before the grant
    runs out the reader looks the request up, which holds the blocks longer, and the pull succeeds
    instead of being cut off where the grant ended."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-delayed", 0.0, times_out=True)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await _still_works(pw, p, dw, rid="warm")  # handshaken: the grant's READ is the first thing that waits
    await pw.prefill("long", {"kv": [1, 2]}, salt=3, lease=2.0)
    await dw.client.expect("long", [p.peer_address])
    assert d.core is not None
    for _ in range(200):
        if "long" in d.core.holds.grants:
            break
        await asyncio.sleep(0.01)
    assert "long" in d.core.holds.grants
    lookups = peer_lookups(p)
    dp.delay = 2.5
    res = await dw.pull("long", [p], {"kv": [3, 4]}, remote_blocks={"kv": [1, 2]})
    assert dw.verify({"kv": [3, 4]}, 3) == (res.bytes, 0)
    assert lookups == ["long"]  # the one that held the blocks past the grant


@pytest.mark.parametrize("ahead", [False, True], ids=["after-the-lookup", "ahead-of-the-lookup"])
async def test_a_read_must_end_while_the_lookup_holds_the_blocks(harness: Harness, ahead: bool) -> None:
    """The publisher holds looked-up blocks for its own --transfer-timeout-seconds (1 s here), shorter
    than the reader's (30 s): a READ that takes 2 s fails instead of finishing on blocks whose lease
    ran out under it: at the publisher's bound when it started after the lookup's answer, or once it
    ended (its bytes unused) when it started ahead of it (the worker named the publisher's ids)."""
    p = await harness.sidecar(role="prefill", engine_id="prefill", transfer_timeout_seconds=1.0)
    dp = DelayedDataPlane("decode-delayed", 2.0, times_out=True)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, transfer_timeout_seconds=30.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("slow", {"kv": [1, 2]}, salt=1, lease=0.5)
    t0 = time.monotonic()
    if ahead:
        pull = dw.pull("slow", [p], {"kv": [3, 4]}, remote_blocks={"kv": [1, 2]})
        await expect_error(OK.DEADLINE_EXCEEDED, pull, "outlasted the time a publisher held the blocks")
    else:
        await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("slow", [p], {"kv": [3, 4]}),
                           "data plane READ from", "did not finish within")  # fmt: skip
        assert time.monotonic() - t0 < 1.9  # at the publisher's bound, not after the 2 s READ
    dp.delay = 0.0
    await _still_works(pw, p, dw)


async def test_an_unfenced_read_fails_the_pull_with_its_own_reason(harness: Harness) -> None:
    """The pull's deadline cancels a READ the data plane then reports unfenced (still in flight after the fence
    budget): the pull fails with reason DATA_PLANE_UNFENCED, not DEADLINE, so the worker learns the blocks
    may still be written; counted in kvxfer_data_plane_unfenced_total."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-delayed", 3.0, unfenced=True)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, transfer_timeout_seconds=1.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("stalled", {"kv": [1, 2]}, salt=1)
    exc = await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("stalled", [p], {"kv": [3, 4]}), "may still land")
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    assert d.metrics is not None
    assert d.metrics.unfenced.labels(op="read")._value.get() == 1
    dp.delay = 0.0
    await _still_works(pw, p, dw)


async def test_an_unfenced_pull_stays_unsettled_until_its_read_ended(harness: Harness) -> None:
    """A pull fails unfenced: GetStatus names it in ``unsettled`` (its worker keeps the blocks) until the data
    plane sees the READ end, then no more; the kvxfer_unsettled_pulls gauge follows. Ids it never failed
    unfenced are not named, and more than 1024 ids is INVALID_ARGUMENT naming the field."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-unsettled", 30.0, unfenced=True, fence_seconds=0.2)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("late", {"kv": [1, 2]}, salt=1)
    exc = await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("late", [p], {"kv": [3, 4]}, deadline=0.5),
                             "may still land")  # fmt: skip
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    assert len(dp.unfenced_ops) == 1
    status = await dw.client.status(unsettled=["late", "never-pulled"])
    assert status["unsettled"] == ["late"]
    assert d.metrics is not None
    assert d.metrics.unsettled.collect()[0].samples[0].value == 1
    assert (await dw.client.status(unsettled=["late"]))["unsettled"] == ["late"]  # asking again changes nothing
    dp.unfenced_ops[0].ended = True  # the data plane saw the READ end
    assert (await dw.client.status(unsettled=["late"]))["unsettled"] == []
    assert d.metrics.unsettled.collect()[0].samples[0].value == 0
    await expect_error(OK.INVALID_ARGUMENT, dw.client.status(unsettled=[f"r{i}" for i in range(1025)]),
                       "unsettled: 1025 request ids; at most 1024")  # fmt: skip


async def test_an_idle_sidecar_looks_again_at_an_unfenced_read_until_it_ended(harness: Harness) -> None:
    """Nobody asks about the failed pull (no GetStatus, no more transfers): the sidecar still asks the data
    plane about the READ it left in flight about once a second (NIXL releases an ended operation's handle
    only when asked), and stops once the READ ended. It used to keep the handle until someone asked."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-idle", 30.0, unfenced=True, fence_seconds=0.2)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("idle", {"kv": [1, 2]}, salt=1)
    await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("idle", [p], {"kv": [3, 4]}, deadline=0.3), "may still land")
    looks = dp.looks
    await asyncio.sleep(2.5)
    assert dp.looks >= looks + 2, "the idle sidecar did not look again on its own"
    dp.unfenced_ops[0].ended = True
    await asyncio.sleep(1.5)  # the next look finds it ended: nothing is held any more
    looks = dp.looks
    await asyncio.sleep(2.5)
    assert dp.looks == looks, "still looking with nothing held"
    assert d.metrics is not None
    assert d.metrics.unsettled.collect()[0].samples[0].value == 0


async def test_an_unfenced_pull_no_one_can_watch_is_unsettled_for_the_hold_only(harness: Harness) -> None:
    """A READ left in flight that its data plane cannot watch never ends: the pull stays unsettled for
    --unfenced-hold-seconds (1 s here), then GetStatus no longer names it."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-unwatched", 30.0, unfenced=True, fence_seconds=0.2)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, unfenced_hold_seconds=1.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("lost", {"kv": [1, 2]}, salt=1)
    t0 = time.monotonic()
    await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("lost", [p], {"kv": [3, 4]}, deadline=0.3), "may still land")
    dp.unfenced_ops[0].watched = False  # the library lost sight of it
    assert (await dw.client.status(unsettled=["lost"]))["unsettled"] == ["lost"]
    while (await dw.client.status(unsettled=["lost"]))["unsettled"]:
        assert time.monotonic() - t0 < 5.0, "still unsettled long after the hold"
        await asyncio.sleep(0.05)
    assert time.monotonic() - t0 >= 1.0


async def test_the_worker_waits_out_the_sidecars_fence_for_a_failed_pulls_answer(harness: Harness) -> None:
    """A pull that fails at its deadline is answered once the data plane fenced its READs, up to
    --fence-budget-seconds later (2 s here). The client learns that budget at registration and waits
    for the answer: it used to give up a second after the deadline (DEADLINE_EXCEEDED, reason DEADLINE),
    and its worker would have reused blocks the READ could still land in."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-fenced", 30.0, unfenced=True, fence_seconds=2.0)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, fence_budget_seconds=2.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    assert dw.client.fence_budget == 2.0
    assert dw.client.pull_timeout(0.5) == 0.5 + 2.0 + 1.0
    await pw.prefill("fenced", {"kv": [1, 2]}, salt=1)
    t0 = time.monotonic()
    exc = await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("fenced", [p], {"kv": [3, 4]}, deadline=0.5),
                             "may still land")  # fmt: skip
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    assert 2.3 < time.monotonic() - t0 < 3.5


async def test_a_gone_workers_memory_is_released_only_once_its_reads_were_fenced(harness: Harness) -> None:
    """The worker exits while a READ into its blocks is in flight and its fence takes 3 s (within the 4 s
    --fence-budget-seconds): its memory is deregistered and unmapped only once the READ's transfer returned.
    It used to go after 2 s (worker_gone's fixed wait), while the READ could still land in it."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-gone", 30.0, unfenced=True, fence_seconds=3.0)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp, fence_budget_seconds=4.0)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("gone", {"kv": [1, 2]}, salt=1)
    pull = asyncio.ensure_future(dw.pull("gone", [p], {"kv": [3, 4]}, deadline=20.0))
    await asyncio.wait_for(dp.reading.wait(), 5)
    at_deregister = await gone_worker_released(d, dp)
    assert at_deregister == [0] * len(at_deregister), "released while a READ into it was in flight"
    pull.cancel()


async def test_a_pull_whose_other_read_was_cancelled_unfenced_fails_unfenced(harness: Harness) -> None:
    """Two source ranks: one READ fails by itself, so the pull cancels the other, which stays in flight past
    the fence budget. The pull fails with reason DATA_PLANE_UNFENCED (it carried the first READ's DATA_PLANE,
    and the worker would reuse blocks the other READ may still land in)."""
    lay = attention(tp=2)
    dp = DelayedDataPlane("decode-two", 30.0, unfenced=True, fence_seconds=0.3, fail_first=0.3)
    ps = [await harness.sidecar(f"p{q}", role="prefill", engine_id="prefill") for q in range(2)]
    pw = [await harness.worker(ps[q], {"kv": lay}, (q, 2)) for q in range(2)]
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    dw = await harness.worker(d, {"kv": attention()})
    for w in pw:
        await w.prefill("two", {"kv": [1, 2]}, salt=1)
    exc = await expect_error(OK.UNAVAILABLE, dw.pull("two", ps, {"kv": [3, 4]}, deadline=20.0), "may still land")
    assert exc.reason == Reason.DATA_PLANE_UNFENCED


async def test_transfer_deadline(harness: Harness) -> None:
    p, pw, d, dw, dp = await _pair(harness, delay=3.0, transfer_timeout_seconds=1.0)
    await pw.prefill("slow", {"kv": [1, 2]}, salt=1)
    t0 = time.monotonic()
    await expect_error(OK.DEADLINE_EXCEEDED, dw.pull("slow", [p], {"kv": [3, 4]}, deadline=0.5),
                       "pull of 'slow' did not finish within 0.5s (while reading from rank 0")  # fmt: skip
    assert time.monotonic() - t0 < 2.0
    # A call without any deadline of its own still ends: the sidecar's --transfer-timeout-seconds.
    await pw.prefill("slow2", {"kv": [1, 2]}, salt=1)
    req = local_pb2.PullRequest(request_id="slow2", remote_addresses=[p.peer_address], wait=True,
                                local_blocks=[common_pb2.BlockList(group="kv", block_ids=[3, 4])])  # fmt: skip
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(d.local_target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await local_pb2_grpc.LocalStub(ch).Pull(req)  # no timeout
    assert info.value.code() == OK.DEADLINE_EXCEEDED
    assert "pull of 'slow2' did not finish within 1s" in (info.value.details() or "")
    assert time.monotonic() - t0 < 2.5
    assert dp is not None
    dp.delay = 0.0
    await _still_works(pw, p, dw)


async def test_wrong_role_and_no_registration(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill")
    c = AsyncClient(p.local_target)
    await expect_error(OK.FAILED_PRECONDITION, c.publish("r", {"kv": [1]}), "no KV caches registered")
    await c.close()
    pw = await harness.worker(p, {"kv": LAY})
    await expect_error(OK.FAILED_PRECONDITION, pw.pull("r", [p], {"kv": [1]}), "--role prefill")


async def test_drain_finishes_in_flight_work_and_refuses_new(harness: Harness) -> None:
    p, pw, d, dw, dp = await _pair(harness, delay=0.5)
    await pw.prefill("d1", {"kv": [1, 2]}, salt=1)
    await pw.prefill("d2", {"kv": [3]}, salt=2)  # never pulled: released by the drain
    pull = asyncio.ensure_future(dw.pull("d1", [p], {"kv": [5, 6]}))
    assert dp is not None
    await asyncio.wait_for(dp.reading.wait(), 5)
    drain = asyncio.ensure_future(d.drain(5.0))
    await asyncio.sleep(0.05)
    await expect_error(OK.UNAVAILABLE, dw.pull("d2", [p], {"kv": [7]}), "draining")
    res = await pull  # the in-flight pull finishes during the drain
    assert res.done
    assert dw.verify({"kv": [5, 6]}, 1)[1] == 0
    summary = await drain
    assert (summary.completed, summary.abandoned) == (1, 0)
    p_drain = await pw.client.drain(0.2)
    assert p_drain["released_leases"] == 1  # d2
    await expect_error(OK.UNAVAILABLE, pw.client.publish("d3", {"kv": [1]}), "draining")


async def _leases(w: Worker, n: int) -> bool:
    return bool((await w.client.status())["leases"] == n)


async def _in_flight_zero(w: Worker) -> bool:
    return bool((await w.client.status())["transfers_in_flight"] == 0)


async def _first_event(worker: Worker, kind: str) -> object:
    async for ev in worker.client.watch_completions():
        if ev.kind == kind:
            return ev
    raise AssertionError("stream ended")


async def test_a_pull_that_times_out_on_a_replaced_session_leaves_the_newer_one_alone(harness: Harness) -> None:
    """Pull "a" reads on the first session to the publisher; pull "b"'s READ fails there, which drops that
    session; pull "c" handshakes again and reads on the new one. "a" then reaches its deadline: that says
    nothing about the new session, which "c" still reads on (the deadline dropped it, and "c" failed with the
    peer gone from the data plane). FAULT INJECTOR (helpers): each READ is held 1 s; "b"'s fails at once."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-sessions", 1.0, fail_first=0.05)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    for salt, rid in enumerate("abc", start=1):
        await pw.prefill(rid, {"kv": [salt]}, salt=salt)
    b = asyncio.ensure_future(dw.pull("b", [p], {"kv": [12]}))
    await asyncio.wait_for(dp.reading.wait(), 5)
    a = asyncio.ensure_future(dw.pull("a", [p], {"kv": [11]}, deadline=0.7))
    await expect_error(OK.UNAVAILABLE, b, "the connection broke")
    c = await dw.pull("c", [p], {"kv": [13]})
    assert dw.verify({"kv": [13]}, 3) == (c.bytes, 0)
    await expect_error(OK.DEADLINE_EXCEEDED, a)
