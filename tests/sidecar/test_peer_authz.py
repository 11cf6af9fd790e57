"""Peer calls act only on what the caller may touch: who it is comes from its handshake and credentials.

Every sidecar here is real (grpc.aio + NIXL on loopback). A *rogue* peer is a raw gRPC client of the
peer API that handshakes (or not) under an engine id of its choosing, as any holder of the cluster
token may: it looks like the decode sidecar in everything but its engine and instance ids.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import grpc
import pytest

from kvxfer.errors import Reason
from kvxfer.layout import KVCacheLayout
from kvxfer.server import peers as peers_module
from kvxfer.server import pusher as pusher_module
from kvxfer.server import readers as readers_module
from kvxfer.server.app import Sidecar
from kvxfer.wire import common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer.wire.status import error_from_status
from tests.sidecar.conftest import JsonLogs
from tests.sidecar.helpers import Harness, Worker, attention, expect_error

OK = grpc.StatusCode
LAY = attention()
MLA = KVCacheLayout.mla(num_layers=2, num_blocks=64, block_size=16, latent_dim=576)  # the same on every rank
RANK0 = common_pb2.Rank(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


async def _refused(call: Any) -> tuple[grpc.StatusCode, str, Reason, str | None]:
    """(code, message, reason, field) of a raw peer call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = info.value
    reason, field = error_from_status(err.code(), err.details() or "", err.trailing_metadata())
    return err.code(), err.details() or "", reason, field


def _rogue_info(decode: Sidecar, engine_id: str = "rogue", instance_id: str = "feedbeef") -> peer_pb2.PeerInfo:
    """The decode sidecar's handshake, under another engine and instance id."""
    assert decode.core is not None
    info = decode.core.identity().to_proto()
    info.engine_id, info.instance_id = engine_id, instance_id
    return info


async def _leases(worker: Worker) -> int:
    return int((await worker.client.status())["leases"])


async def _publish(worker: Worker, rid: str, blocks: list[int], salt: int, **kw: Any) -> None:
    worker.fill({"kv": blocks}, salt)
    await worker.client.publish(rid, {"kv": blocks}, **kw)


# ---------------------------------------------------------------------- Revoke (push mode)
async def test_a_revoke_from_a_peer_that_never_handshook_is_refused_and_frees_no_later_publish(
    harness: Harness,
) -> None:
    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    revoke = peer_pb2.RevokeRequest(request_id="r9", engine_id="rogue", instance_id="feedbeef", rank=RANK0)
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        code, message, reason, field = await _refused(peer_pb2_grpc.PeerStub(ch).Revoke(revoke, timeout=5))
    assert (code, reason, field) == (OK.FAILED_PRECONDITION, Reason.NOT_HANDSHAKEN, "engine_id")
    assert message == ("engine_id: reader 'rogue' (instance 'feedbeef', tp rank 0) has not handshaken with this "
                       "sidecar and holds no offer of 'r9' here; revoke refused")  # fmt: skip
    await _publish(pw[0], "r9", [1, 2], salt=9, reader_engine_id="decode")
    await asyncio.sleep(0.2)
    assert await _leases(pw[0]) == 1  # still held for its reader
    res = await dw[0].pull("r9", ps, {"kv": [3, 4]})
    assert dw[0].verify({"kv": [3, 4]}, 9) == (res.bytes, 0)


async def test_a_give_up_frees_only_a_publish_unbound_or_bound_to_the_engine_that_gave_up(harness: Harness) -> None:
    """A handshaken reader revokes requests not published yet: a publish bound to another engine stays held
    (its reader pulls it, every byte right); one unbound, or bound to the engine that gave up, is freed at once."""
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    assert ds[0].core is not None
    decode = ds[0].core.identity()
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Handshake(peer_pb2.HandshakeRequest(info=_rogue_info(ds[0])), timeout=5)
        for rid in ("r9", "r10"):
            resp = await stub.Revoke(peer_pb2.RevokeRequest(request_id=rid, engine_id="rogue", instance_id="feedbeef",
                                                            rank=RANK0), timeout=5)  # fmt: skip
            assert (resp.found, resp.wrote) == (False, False)
        # The decode engine's own sidecar gives up on r11 (it handshook when it pulled r0).
        await _publish(pw[0], "r0", [6], salt=1)
        res0 = await dw[0].pull("r0", ps, {"kv": [5]})
        assert dw[0].verify({"kv": [5]}, 1) == (res0.bytes, 0)
        mine = peer_pb2.RevokeRequest(request_id="r11", engine_id="decode", instance_id=decode.instance_id, rank=RANK0)
        resp = await stub.Revoke(mine, timeout=5)
        assert not resp.found
    await _wait_leases(pw[0], 0)
    await _publish(pw[0], "r9", [1, 2], salt=9, reader_engine_id="decode")  # rogue gave up: not its to give up
    await _publish(pw[0], "r10", [3], salt=10)  # unbound: any reader that handshook may drop it
    await _publish(pw[0], "r11", [4], salt=11, reader_engine_id="decode")  # its own reader gave up
    await asyncio.sleep(0.2)
    assert (await pw[0].client.status(publishes=["r9", "r10", "r11"]))["publishes"].keys() == {"r9"}
    res = await dw[0].pull("r9", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 9) == (res.bytes, 0)
    await _wait_leases(pw[0], 0)


async def test_a_lapsed_offer_frees_no_publish_bound_to_another_engine(harness: Harness) -> None:
    """A handshaken rogue offers a request not published yet and lets the offer lapse: the publish that
    comes later, bound to the decode engine, stays held and is read by it."""
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    info = _rogue_info(ds[0])
    assert ps[0].core is not None
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
        offer = peer_pb2.OfferRequest(request_id="r9", engine_id="rogue", instance_id="feedbeef", rank=RANK0,
                                      epoch=info.epoch, blocks=[common_pb2.BlockList(group="kv", block_ids=[1, 2])],
                                      timeout_seconds=0.3)  # fmt: skip
        assert not (await stub.Offer(offer, timeout=5)).published
    await _until(lambda: not ps[0].core.pusher.offers)  # type: ignore[union-attr]  # lapsed
    await _publish(pw[0], "r9", [3, 4], salt=9, reader_engine_id="decode")
    await asyncio.sleep(0.2)
    assert await _leases(pw[0]) == 1
    res = await dw[0].pull("r9", ps, {"kv": [5, 6]})
    assert dw[0].verify({"kv": [5, 6]}, 9) == (res.bytes, 0)


async def test_give_ups_are_capped_and_forgotten_in_time_without_new_ones(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most GIVEN_UP_KEPT give-ups are kept (the oldest go first), each for --transfer-timeout-seconds +
    --lease-seconds (1 s here), even when no other comes to prune them."""
    monkeypatch.setattr(pusher_module, "GIVEN_UP_KEPT", 8, raising=False)
    ps, _pw, ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, transfer_timeout_seconds=0.5,
                                                lease_seconds=0.5)  # fmt: skip
    pusher = ps[0].core.pusher  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Handshake(peer_pb2.HandshakeRequest(info=_rogue_info(ds[0])), timeout=5)
        for n in range(12):
            await stub.Revoke(peer_pb2.RevokeRequest(request_id=f"g{n}", engine_id="rogue", instance_id="feedbeef",
                                                     rank=RANK0), timeout=5)  # fmt: skip
    assert len(pusher._given_up) == 8
    assert list(pusher._given_up) == [(f"g{n}", "rogue") for n in range(4, 12)]
    await asyncio.sleep(1.3)  # nothing else happens meanwhile
    assert len(pusher._given_up) == 0  # forgotten by its timer: nothing accessed it meanwhile
    assert pusher._given_up.keys_of("g11") == []


async def test_a_writer_that_forgot_the_reader_refuses_its_revoke_and_the_fence_goes_on_at_once(
    harness: Harness,
) -> None:
    """Not a regression of the refusal above: a writer that does not know the reader holds no offer of it,
    so the reader's fence takes NOT_HANDSHAKEN as "nothing can land" and reports the abort at once."""
    ps, _pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    writer = ps[0].core
    assert writer is not None
    pull = asyncio.ensure_future(dw[0].client.pull("w", [ps[0].peer_address], {"kv": [4, 5]}, push=True,
                                                   deadline=10.0))  # fmt: skip
    await _until(lambda: writer.pusher.offers.get("w"))
    # FAULT INJECTION: the writer crashed and came back on its address; it knows neither the reader nor its offer.
    writer.pusher._forget(next(iter(writer.pusher.offers["w"].values())))
    for key in list(writer.publisher.readers):
        writer.publisher.readers.forget(key)
    t0 = time.monotonic()
    assert await dw[0].client.abort("w", "user cancelled") == (1, False)
    await expect_error(OK.ABORTED, pull, "pull of 'w' aborted: user cancelled")
    assert time.monotonic() - t0 < 1.0  # not the 10 s the fence waits for a writer it cannot reach


async def _wait_leases(worker: Worker, n: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while await _leases(worker) != n:
        assert time.monotonic() < deadline, f"leases never reached {n}"
        await asyncio.sleep(0.02)


async def _until(pred: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- Handshake: the readers table
def _flood_info(decode: Sidecar, engine_id: str, instance_id: str, tp_rank: int, tp_size: int,
                metadata: bytes = b"") -> peer_pb2.PeerInfo:  # fmt: skip
    info = _rogue_info(decode, engine_id, instance_id)
    info.rank.tp_rank, info.rank.tp_size = tp_rank, tp_size
    if metadata:
        info.data_plane.metadata = metadata
    return info


async def test_a_handshake_claiming_more_ranks_than_a_reader_may_have_is_refused(harness: Harness) -> None:
    ps, _pw, ds, _dw = await harness.deployment({"kv": MLA}, {"kv": MLA})
    publisher = ps[0].core.publisher  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        huge = _flood_info(ds[0], "decode", "flood", 7, 1_000_000)
        code, message, reason, field = await _refused(stub.Handshake(peer_pb2.HandshakeRequest(info=huge), timeout=5))
        assert (code, reason, field) == (OK.INVALID_ARGUMENT, Reason.INVALID_FIELD, "info.rank.tp_size")
        assert message == "info.rank.tp_size: 1000000 is more than the 256 ranks a reader may have"
        past = _flood_info(ds[0], "decode", "flood", 8, 8)
        code, message, reason, field = await _refused(stub.Handshake(peer_pb2.HandshakeRequest(info=past), timeout=5))
        assert (code, message, field) == (OK.INVALID_ARGUMENT, "info.rank.tp_rank: 8 is not in [0, 8)",
                                          "info.rank.tp_rank")  # fmt: skip
        await stub.Handshake(peer_pb2.HandshakeRequest(info=_flood_info(ds[0], "decode", "flood", 255, 256)),
                             timeout=5)  # fmt: skip
    assert list(publisher.readers) == [("decode", "flood", 255, 0)]


async def test_one_engine_cannot_grow_the_readers_table_past_its_share(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handshakes under one engine, each a new rank with 64 KiB of data-plane metadata: only the newest
    READERS_PER_ENGINE (8 here) are kept, and the other engines' readers are untouched (the decode sidecar
    reads on without handshaking again); READERS_KEPT bounds every engine together the same way."""
    monkeypatch.setattr(readers_module, "READERS_PER_ENGINE", 8, raising=False)
    ps, pw, ds, dw = await harness.deployment({"kv": MLA}, {"kv": MLA})
    publisher = ps[0].core.publisher  # type: ignore[union-attr]
    assert ds[0].core is not None
    decode = ds[0].core.identity()
    await _publish(pw[0], "r0", [1], salt=1)
    res = await dw[0].pull("r0", ps, {"kv": [2]})
    assert dw[0].verify({"kv": [2]}, 1) == (res.bytes, 0)
    handshakes = ds[0].metrics.handshakes.labels(outcome="ok")._value.get()  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for k in range(20):
            info = _flood_info(ds[0], "rogue", "flood", k, 20, metadata=bytes(64 << 10))
            await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
    assert list(publisher.readers) == [("decode", decode.instance_id, 0, 0)] + [
        ("rogue", "flood", k, 0) for k in range(12, 20)
    ]
    assert publisher.knows("rogue", "flood")
    assert publisher.knows("decode", decode.instance_id)
    assert publisher.count_readers() == 2
    await _publish(pw[0], "r1", [3], salt=2)
    res = await dw[0].pull("r1", ps, {"kv": [4]})
    assert dw[0].verify({"kv": [4]}, 2) == (res.bytes, 0)
    assert ds[0].metrics.handshakes.labels(outcome="ok")._value.get() == handshakes  # type: ignore[union-attr]
    # Every engine together: the longest unused go first (the decode sidecar's lookup of r1 was the last use).
    monkeypatch.setattr(readers_module, "READERS_KEPT", 4, raising=False)
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for k in range(3):
            info = _flood_info(ds[0], f"e{k}", "other", 0, 1)
            await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
    assert list(publisher.readers) == [("decode", decode.instance_id, 0, 0), ("e0", "other", 0, 0),
                                       ("e1", "other", 0, 0), ("e2", "other", 0, 0)]  # fmt: skip
    assert publisher.knows("decode", decode.instance_id)
    assert not publisher.knows("rogue", "flood")
    assert publisher.count_readers() == 4


async def test_a_reader_in_use_outlives_the_readers_that_came_and_went_since_its_handshake(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table forgets the longest unused reader first, not the oldest handshake: decode pods that
    are replaced (new engine ids) do not push out a long-lived reader that keeps pulling (it used
    to be forgotten, then refused, its data-plane peer torn down under its other READs)."""
    monkeypatch.setattr(readers_module, "READERS_KEPT", 3, raising=False)
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    publisher = ps[0].core.publisher  # type: ignore[union-attr]
    assert ds[0].core is not None
    decode = ds[0].core.identity()
    handshakes = ds[0].metrics.handshakes.labels(outcome="ok")._value.get()  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for k in range(6):  # pods that come and go, one pull of the long-lived reader between each
            await _publish(pw[0], f"u{k}", [1 + k], salt=10 + k)
            res = await dw[0].pull(f"u{k}", ps, {"kv": [2 + k]})
            assert dw[0].verify({"kv": [2 + k]}, 10 + k) == (res.bytes, 0)
            await stub.Handshake(peer_pb2.HandshakeRequest(info=_flood_info(ds[0], f"gone{k}", "x", 0, 1)), timeout=5)
    assert publisher.knows("decode", decode.instance_id)
    assert ds[0].metrics.handshakes.labels(outcome="ok")._value.get() == handshakes + 1  # type: ignore[union-attr]
    assert publisher.count_readers() == 3


async def test_a_lookup_counts_the_readers_of_the_handshake_not_the_tp_size_it_names(harness: Harness) -> None:
    """Who must confirm a publish is worked out from the reader's handshake; a GetPublished naming another
    TP size (here 200 ranks, each a topology to plan) changes nothing."""
    ps, pw, ds, _dw = await harness.deployment({"kv": MLA}, {"kv": MLA})
    publisher = ps[0].core.publisher  # type: ignore[union-attr]
    await _publish(pw[0], "r1", [3], salt=2)
    info = _rogue_info(ds[0])
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
        wide = common_pb2.Rank(tp_rank=0, tp_size=200, pp_size=1)
        req = peer_pb2.GetPublishedRequest(request_id="r1", engine_id="rogue", instance_id="feedbeef", rank=wide,
                                           epoch=info.epoch)  # fmt: skip
        resp = await stub.GetPublished(req, timeout=5)
    assert list(resp.groups[0].block_ids) == [3]
    entry = publisher.publishes["r1"]
    assert (entry.reader_tp_size, entry.expected_readers) == (1, {0})


async def test_a_reader_the_publisher_forgot_handshakes_again_and_reads_on(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a regression of the bounds above: a reader rank forgotten for newer handshakes of its engine (one
    rank kept per engine here) is refused NOT_HANDSHAKEN; its push offer handshakes again and is written,
    and its holds handshake again at their next round and are granted."""
    monkeypatch.setattr(readers_module, "READERS_PER_ENGINE", 1, raising=False)
    ps, pw, ds, dw = await harness.deployment({"kv": MLA}, {"kv": MLA})
    publisher = ps[0].core.publisher  # type: ignore[union-attr]
    reader = ds[0].core  # type: ignore[union-attr]
    assert reader is not None
    await _publish(pw[0], "r0", [1], salt=1)
    res = await dw[0].pull("r0", ps, {"kv": [2]})
    assert dw[0].verify({"kv": [2]}, 1) == (res.bytes, 0)

    async def crowd_out() -> None:
        async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
            info = _flood_info(ds[0], "decode", "flood", 1, 2)
            await peer_pb2_grpc.PeerStub(ch).Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
        assert not publisher.knows("decode", reader.instance_id)

    await crowd_out()
    dw[0].poison({"kv": [4, 5]})
    pull = asyncio.ensure_future(dw[0].client.pull("p1", [ps[0].peer_address], {"kv": [4, 5]}, push=True))
    await asyncio.sleep(0.2)
    await _publish(pw[0], "p1", [6, 7], salt=3)
    res = await pull
    assert dw[0].verify({"kv": [4, 5]}, 3) == (res.bytes, 0)
    await crowd_out()
    await _publish(pw[0], "h1", [8], salt=4)
    assert await dw[0].client.expect("h1", [ps[0].peer_address])
    await _until(lambda: "h1" in reader.holds.grants, within=4.0)  # refused once, granted at the retry (1 s)
    res = await dw[0].pull("h1", ps, {"kv": [9]})
    assert dw[0].verify({"kv": [9]}, 4) == (res.bytes, 0)


# ---------------------------------------------------------------------- Abort (reader side): holds
async def test_an_abort_from_a_publisher_the_request_is_not_expected_from_leaves_its_holds(harness: Harness) -> None:
    """The decode sidecar reads from two prefill engines. Engine "prefill" (a publisher it has a session with)
    aborts r5, which the decode worker expects from "prefill2" only: the holds at prefill2 go on, so r5
    outlives its 1 s lease and is read, every byte right. Abort from prefill2 itself drops them."""
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, lease_seconds=30)
    p2 = await harness.sidecar(role="prefill", engine_id="prefill2")
    p2w = await harness.worker(p2, {"kv": LAY})
    reader = ds[0].core
    assert reader is not None
    assert ps[0].core is not None
    await _publish(pw[0], "r0", [1], salt=1)
    res = await dw[0].pull("r0", ps, {"kv": [2]})  # the decode sidecar now has a session with "prefill"
    assert dw[0].verify({"kv": [2]}, 1) == (res.bytes, 0)
    await _publish(p2w, "r5", [3, 4], salt=5, lease_seconds=1.0)
    assert await dw[0].client.expect("r5", [p2.peer_address])
    await _until(lambda: "r5" in reader.holds.grants)
    abort = peer_pb2.PeerAbortRequest(request_id="r5", engine_id="prefill", instance_id=ps[0].core.instance_id,
                                      reason="not mine")  # fmt: skip
    async with grpc.aio.insecure_channel(ds[0].peer_address) as ch:
        assert not (await peer_pb2_grpc.PeerStub(ch).Abort(abort, timeout=5)).found
    assert list(reader.holds.grants["r5"]) == [p2.peer_address]
    assert reader.holds.expected["r5"].addresses == (p2.peer_address,)
    await asyncio.sleep(2.5)  # 2.5 leases
    assert (await p2w.client.status(publishes=["r5"]))["publishes"].keys() == {"r5"}
    res = await dw[0].pull("r5", [p2], {"kv": [5, 6]})
    assert dw[0].verify({"kv": [5, 6]}, 5) == (res.bytes, 0)
    # Its own publisher's abort does drop them.
    await _publish(p2w, "r6", [7], salt=6)
    assert await dw[0].client.expect("r6", [p2.peer_address])
    await _until(lambda: "r6" in reader.holds.grants)
    assert p2.core is not None
    abort = peer_pb2.PeerAbortRequest(request_id="r6", engine_id="prefill2", instance_id=p2.core.instance_id)
    async with grpc.aio.insecure_channel(ds[0].peer_address) as ch:
        assert not (await peer_pb2_grpc.PeerStub(ch).Abort(abort, timeout=5)).found
    assert "r6" not in reader.holds.grants
    assert "r6" not in reader.holds.expected


# ---------------------------------------------------------------------- Hold answers (reader side)
def _grant_for(prefill: Sidecar, held_seconds: float) -> None:
    """FAULT INJECTOR: ``prefill``'s Hold answers carry grants of ``held_seconds``, as a broken or hostile
    publisher would send them (an honest one grants a finite time >= 0; nothing else produces these)."""
    core = prefill.core
    assert core is not None
    honest = core.peer_hold

    async def lying(req: Any, *args: Any) -> Any:
        resp = await honest(req, *args)
        for g in resp.grants:
            g.held_seconds = held_seconds
        return resp

    core.peer_hold = lying  # type: ignore[method-assign]


@pytest.mark.parametrize("held_seconds", [math.nan, math.inf, -1.0])
async def test_a_grant_of_no_usable_length_is_not_read_on(
    harness: Harness, json_logs: JsonLogs, held_seconds: float
) -> None:
    """A Hold answer whose grant is NaN, infinite or negative is the publisher's input error: the grant is
    dropped (logged with the peer), and the pull looks the request up instead, every byte right."""
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, lease_seconds=30)
    reader = ds[0].core
    assert reader is not None
    _grant_for(ps[0], held_seconds)
    await _publish(pw[0], "g", [1, 2], salt=4)
    assert await dw[0].client.expect("g", [ps[0].peer_address])
    await _until(lambda: "g" not in reader.holds._first)  # the first Hold was answered
    assert "g" not in reader.holds.grants
    (warning,) = [r for r in json_logs.records() if r["msg"].startswith("publisher granted a hold")]
    assert (warning["level"], warning["peer"], warning["request_id"]) == ("warning", ps[0].peer_address, "g")
    assert (warning["held_seconds"], warning["reason"]) == (repr(held_seconds), "PEER_INPUT")
    res = await dw[0].pull("g", ps, {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]})
    assert dw[0].verify({"kv": [5, 6]}, 4) == (res.bytes, 0)
    assert ds[0].metrics is not None
    assert (ds[0].metrics.registry.get_sample_value("kvxfer_pulls_by_path_total", {"path": "grant"}) or 0.0) == 0.0


# ---------------------------------------------------------------------- GetPublished: no probing
async def test_a_caller_that_never_handshook_cannot_tell_which_requests_are_published(harness: Harness) -> None:
    """GetPublished (alone or in a batch) refuses a caller that did not handshake the same way whether the
    request is published or not; a handshaken reader still hears NOT_FOUND for a request nobody published."""
    ps, pw, ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await _publish(pw[0], "held", [1, 2], salt=1)
    stranger = dict(engine_id="stranger", instance_id="feedbeef", rank=RANK0)
    refusal = ("engine_id: reader 'stranger' (instance feedbeef) has not handshaken with this sidecar; "
               "handshake first")  # fmt: skip
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for rid in ("held", "never-published"):
            answer = await _refused(stub.GetPublished(peer_pb2.GetPublishedRequest(request_id=rid, **stranger),
                                                      timeout=5))  # fmt: skip
            assert answer == (OK.FAILED_PRECONDITION, refusal, Reason.NOT_HANDSHAKEN, "engine_id"), rid
        batch = await stub.GetPublishedBatch(peer_pb2.GetPublishedBatchRequest(requests=[
            peer_pb2.GetPublishedRequest(request_id=rid, **stranger) for rid in ("held", "never-published")]),
            timeout=5)  # fmt: skip
        assert [(r.code, r.message, r.reason, r.field) for r in batch.results] == [
            (OK.FAILED_PRECONDITION.value[0], refusal, "NOT_HANDSHAKEN", "engine_id")
        ] * 2
        info = _rogue_info(ds[0])
        await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
        known = dict(engine_id="rogue", instance_id="feedbeef", rank=RANK0, epoch=info.epoch)
        answer = await _refused(stub.GetPublished(peer_pb2.GetPublishedRequest(request_id="never-published",
                                                                               **known), timeout=5))  # fmt: skip
        assert answer == (OK.NOT_FOUND, "request_id: 'never-published' is not published on prefill (unknown, "
                          "released or expired)", Reason.NOT_PUBLISHED, "request_id")  # fmt: skip
        resp = await stub.GetPublished(peer_pb2.GetPublishedRequest(request_id="held", **known), timeout=5)
        assert list(resp.groups[0].block_ids) == [1, 2]


async def test_a_notice_from_a_caller_that_never_handshook_tells_it_nothing(harness: Harness) -> None:
    """Notify, like GetPublished, refuses a caller that neither handshook nor fetched the request the same way
    whether it is published or not; a handshaken reader's notice of an unknown request is still just not
    released."""
    ps, pw, ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await _publish(pw[0], "held", [1, 2], salt=1)
    stranger = dict(engine_id="stranger", instance_id="feedbeef", rank=RANK0)
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for outcome in (peer_pb2.NotifyRequest.DONE, peer_pb2.NotifyRequest.UNREAD):
            for rid in ("held", "never-published"):
                notice = peer_pb2.NotifyRequest(request_id=rid, outcome=outcome, **stranger)
                answer = await _refused(stub.Notify(notice, timeout=5))
                assert answer == (OK.FAILED_PRECONDITION, f"engine_id: 'stranger' (instance 'feedbeef') has not "
                                  f"handshaken with this sidecar; notice of {rid!r} refused", Reason.NOT_HANDSHAKEN,
                                  "engine_id"), (outcome, rid)  # fmt: skip
        await stub.Handshake(peer_pb2.HandshakeRequest(info=_rogue_info(ds[0])), timeout=5)
        notice = peer_pb2.NotifyRequest(request_id="never-published", engine_id="rogue", instance_id="feedbeef",
                                        rank=RANK0, outcome=peer_pb2.NotifyRequest.DONE)  # fmt: skip
        assert not (await stub.Notify(notice, timeout=5)).released
    assert await _leases(pw[0]) == 1


async def test_a_writer_unloads_the_readers_the_publisher_forgot(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode engines replaced under new engine ids: the writer's data plane keeps only the readers the
    publisher still knows (or that hold an offer), not every reader it ever wrote into."""
    monkeypatch.setattr(readers_module, "READERS_KEPT", 1, raising=False)
    p = await harness.sidecar("p", role="prefill", engine_id="prefill")
    pw = await harness.worker(p, {"kv": LAY})
    pusher = p.core.pusher  # type: ignore[union-attr]
    for n in range(3):
        d = await harness.sidecar(f"d{n}", role="decode", engine_id=f"decode{n}")
        dw = await harness.worker(d, {"kv": LAY})
        dw.poison({"kv": [4, 5]})
        pull = asyncio.ensure_future(dw.client.pull(f"q{n}", [p.peer_address], {"kv": [4, 5]}, push=True))
        await asyncio.sleep(0.2)
        await _publish(pw, f"q{n}", [6, 7], salt=n + 1)
        res = await pull
        assert dw.verify({"kv": [4, 5]}, n + 1) == (res.bytes, 0)
        assert [k[0] for k in pusher._loaded] == [f"decode{n}"]


async def test_a_reader_lets_go_of_publishers_it_no_longer_calls(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill pods replaced under new addresses: a publisher not called for a while (IDLE_SECONDS, here 0.4 s,
    and at least twice the longest transfer) loses its session, channel and data-plane peer here; the next pull
    handshakes again and reads."""
    monkeypatch.setattr(peers_module, "IDLE_SECONDS", 0.4, raising=False)
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, transfer_timeout_seconds=0.5)
    reader = ds[0].core
    assert reader is not None
    await _publish(pw[0], "i1", [3], salt=1)
    res = await dw[0].pull("i1", ps, {"kv": [4]})
    assert dw[0].verify({"kv": [4]}, 1) == (res.bytes, 0)
    assert len(reader.peers) == 1
    session = reader.peers.current(ps[0].peer_address)
    assert session is not None
    nixl: Any = getattr(reader.dp, "inner", reader.dp)
    assert session.dp_name in nixl._peers
    await _until(lambda: len(reader.peers) == 0, within=5.0)
    assert session.dp_name not in nixl._peers
    await _publish(pw[0], "i2", [5], salt=2)
    res = await dw[0].pull("i2", ps, {"kv": [6]})
    assert dw[0].verify({"kv": [6]}, 2) == (res.bytes, 0)


# ---------------------------------------------------------------------- Abort: a refusal changes nothing
async def test_an_abort_the_publisher_side_refuses_cancels_no_pull_and_drops_no_hold(harness: Harness) -> None:
    """Two sidecars of role both, each the other's reader and publisher. Y aborts requests X publishes
    bound to another reader ("c"): X refuses (PERMISSION_DENIED, NOT_BOUND_READER), but had already
    dropped its holds at Y and cancelled its own pull from Y of that id. A refused call changes nothing:
    the holds stay and the pull completes, every byte right."""
    x = await harness.sidecar("x", role="both", engine_id="x", lease_seconds=30)
    y = await harness.sidecar("y", role="both", engine_id="y", lease_seconds=30)
    xw, yw = await harness.worker(x, {"kv": LAY}), await harness.worker(y, {"kv": LAY})
    xc, yc = x.core, y.core
    assert xc is not None
    assert yc is not None
    await _publish(xw, "a", [1], salt=1)
    await yw.pull("a", [x], {"kv": [2]})  # y handshook with x as a reader
    await _publish(yw, "b", [3], salt=2)
    await xw.pull("b", [y], {"kv": [4]})  # x has a session with publisher y
    abort = {"engine_id": "y", "instance_id": yc.instance_id, "reason": "not mine to abort"}
    # Holds: x expects "r" from y, and publishes its own "r" for reader "c".
    await _publish(yw, "r", [5, 6], salt=3)
    assert await xw.client.expect("r", [y.peer_address])
    await _until(lambda: "r" in xc.holds.grants)
    await _publish(xw, "r", [7], salt=4, reader_engine_id="c")
    async with grpc.aio.insecure_channel(x.peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        code, _, reason, field = await _refused(stub.Abort(peer_pb2.PeerAbortRequest(request_id="r", **abort),
                                                           timeout=5))  # fmt: skip
        assert (code, reason, field) == (OK.PERMISSION_DENIED, Reason.NOT_BOUND_READER, "engine_id")
        assert list(xc.holds.grants["r"]) == [y.peer_address]
        assert xc.holds.expected["r"].addresses == (y.peer_address,)
        # A pull: x pulls "q" from y in push mode (y has not published it yet) and publishes its own "q" for "c".
        yw.fill({"kv": [8, 9]}, 5)
        xw.poison({"kv": [10, 11]})
        pulling = asyncio.ensure_future(xw.client.pull("q", [y.peer_address], {"kv": [10, 11]}, push=True,
                                                       deadline=20.0))  # fmt: skip
        await _until(lambda: "q" in xc.puller.pulls)
        await _publish(xw, "q", [12], salt=6, reader_engine_id="c")
        code, _, reason, _ = await _refused(stub.Abort(peer_pb2.PeerAbortRequest(request_id="q", **abort), timeout=5))
        assert (code, reason) == (OK.PERMISSION_DENIED, Reason.NOT_BOUND_READER)
    await asyncio.sleep(0.2)
    assert not pulling.done()
    await yw.client.publish("q", {"kv": [8, 9]})
    res = await pulling
    assert xw.verify({"kv": [10, 11]}, 5) == (res.bytes, 0)
    res = await xw.pull("r", [y], {"kv": [13, 14]})  # the request held at y is read on its grant
    assert xw.verify({"kv": [13, 14]}, 3) == (res.bytes, 0)
