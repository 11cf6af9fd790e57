"""What a peer (or a second worker) can reach: registered regions only, through checked ids, after a handshake."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer import PROTOCOL_VERSION
from kvxfer.memory import SharedKVBuffer
from kvxfer.server.app import Sidecar
from kvxfer.topology import RankInfo
from kvxfer.wire import common_pb2, local_pb2, peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import rank_to_proto
from tests.sidecar.helpers import Harness, Worker, attention, expect_error, transfer

OK = grpc.StatusCode
LAY = attention()


async def _pair(harness: Harness) -> tuple[Sidecar, Worker, Sidecar, Worker]:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    return ps[0], pw[0], ds[0], dw[0]


def _tamper(sidecar: Sidecar, edit: Callable[[Any], None]) -> Callable[[], None]:
    """FAULT INJECTOR: the publisher's GetPublished answers, edited as a broken or hostile peer would send them."""
    core = sidecar.core
    assert core is not None
    honest: Callable[[Any, Any], Awaitable[Any]] = core.peer_get_published

    async def lying(req: Any, creds: Any) -> Any:
        resp = await honest(req, creds)
        edit(resp)
        return resp

    core.peer_get_published = lying  # type: ignore[method-assign]
    return lambda: setattr(core, "peer_get_published", honest)


async def test_a_second_rank_cannot_register_with_a_sidecar_that_serves_one(harness: Harness) -> None:
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": attention(tp=2)}, {"kv": attention(tp=1)}, prefill_tp=2, decode_tp=1
    )
    rogue = await harness.worker(ps[0], {"kv": attention(tp=2)}, (1, 2), register=False)
    await expect_error(
        OK.FAILED_PRECONDITION, rogue.register(), "this sidecar serves tp rank 0/2 pp rank 0/1 (worker 'w0')",
        "worker 'w1' registered tp rank 1/2", "One sidecar serves one worker rank",
    )  # fmt: skip
    # The same rank registering again (a restarted worker) is allowed and keeps serving.
    await pw[0].register()
    await transfer(pw, ps, dw, "r1", {"kv": [1, 2, 9]}, {"kv": [3, 4, 5]}, salt=1)


async def test_published_block_ids_from_a_peer_are_checked_before_any_read(harness: Harness) -> None:
    p, pw, _d, dw = await _pair(harness)
    restore = _tamper(p, lambda resp: resp.groups[0].block_ids.__setitem__(1, LAY.num_blocks + 5))
    await pw.prefill("t1", {"kv": [1, 2]}, salt=1)
    dw.poison({"kv": [3, 4]})
    before = [dw.buffers["kv"].pages(layer)[[3, 4]].copy() for layer in range(LAY.num_layers)]
    await expect_error(
        OK.FAILED_PRECONDITION, dw.client.pull("t1", [p.peer_address], {"kv": [3, 4]}),
        f"peer {p.peer_address} published block_ids[kv]: block id 69 at position 1 is out of range [0, 64)",
        "refusing to read",
    )  # fmt: skip
    for layer in range(LAY.num_layers):  # nothing was written into the reader's memory
        assert np.array_equal(dw.buffers["kv"].pages(layer)[[3, 4]], before[layer])
    restore()
    await transfer([pw], [p], [dw], "t2", {"kv": [7, 8]}, {"kv": [3, 4]}, salt=2)


async def test_region_tables_from_a_peer_must_match_its_layout(harness: Harness) -> None:
    p, pw, _d, dw = await _pair(harness)

    def shrink(resp: Any) -> None:
        resp.groups[0].regions[2].size -= 4096  # a region smaller than the layout it announced

    restore = _tamper(p, shrink)
    await pw.prefill("t1", {"kv": [1, 2]}, salt=1)
    err = await expect_error(
        OK.FAILED_PRECONDITION, dw.client.pull("t1", [p.peer_address], {"kv": [3, 4]}),
        f"peer {p.peer_address} regions[kv]", "refusing to read",
    )  # fmt: skip
    assert f"region 2 has {LAY.region_bytes - 4096} bytes, the layout needs {LAY.region_bytes}" in err.details
    restore()
    await transfer([pw], [p], [dw], "t2", {"kv": [7, 8]}, {"kv": [3, 4]}, salt=2)


async def test_regions_named_later_in_a_session_are_not_believed(harness: Harness) -> None:
    # A session is one instance and epoch of the publisher, whose registration (its regions and
    # their memory) cannot change within it: what its first answer named, once checked, is READ from.
    p, pw, _d, dw = await _pair(harness)
    await transfer([pw], [p], [dw], "t1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)

    def elsewhere(resp: Any) -> None:
        for r in resp.groups[0].regions:
            r.base += LAY.region_bytes  # past the memory the handshake and first answer announced
        resp.groups[0].memory_type = "VRAM"  # the data plane finds no such registration: the READ would fail

    restore = _tamper(p, elsewhere)
    try:  # the bytes still come from the regions checked first, exactly
        await transfer([pw], [p], [dw], "t2", {"kv": [7, 8]}, {"kv": [5, 6]}, salt=2)
    finally:
        restore()


async def test_peer_calls_need_a_handshake_and_a_fetch(harness: Harness) -> None:
    p, pw, d, dw = await _pair(harness)
    await pw.prefill("held", {"kv": [1, 2]}, salt=1)
    assert d.core is not None
    me = d.core.identity()
    stranger = dict(request_id="held", engine_id="stranger", instance_id="feedbeef", rank=rank_to_proto(me.rank))
    async with grpc.aio.insecure_channel(p.peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)

        async def refused(call: Any, *fragments: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == OK.FAILED_PRECONDITION, info.value
            for f in fragments:
                assert f in (info.value.details() or ""), (f, info.value.details())

        await refused(stub.GetPublished(peer_pb2.GetPublishedRequest(**stranger), timeout=5),
                      "reader 'stranger' (instance feedbeef) has not handshaken")  # fmt: skip
        done = peer_pb2.NotifyRequest(**stranger, outcome=peer_pb2.NotifyRequest.DONE)
        await refused(stub.Notify(done, timeout=5), "'stranger'", "has not handshaken", "notice of 'held' refused")
        unread = peer_pb2.NotifyRequest(**stranger, outcome=peer_pb2.NotifyRequest.UNREAD)
        await refused(stub.Notify(unread, timeout=5), "has not handshaken with this sidecar; notice of 'held' refused")
        abort = peer_pb2.PeerAbortRequest(request_id="held", engine_id="stranger", instance_id="feedbeef")
        await refused(stub.Abort(abort, timeout=5), "'stranger' (instance 'feedbeef') has not handshaken",
                      "abort of 'held' refused")  # fmt: skip
        # A batch delivers what it may and drops the rest, without failing the call.
        batch = await stub.NotifyBatch(peer_pb2.NotifyBatchRequest(notices=[done, unread]), timeout=5)
        assert batch.released == 0
        # A sidecar that handshook but never fetched this request still cannot free it.
        info = me.to_proto()
        info.instance_id = "c0ffee"
        await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
        other = peer_pb2.NotifyRequest(**{**stranger, "engine_id": me.engine_id, "instance_id": "c0ffee"},
                                       outcome=peer_pb2.NotifyRequest.DONE)  # fmt: skip
        await refused(stub.Notify(other, timeout=5), "did not fetch 'held'")
    assert (await pw.client.status())["leases"] == 1  # nothing above freed the blocks
    res = await dw.pull("held", [p], {"kv": [5, 6]})
    assert dw.verify({"kv": [5, 6]}, 1) == (res.bytes, 0)


async def test_handshake_refusal_lists_every_difference(harness: Harness) -> None:
    p, _pw, d, _dw = await _pair(harness)
    assert d.core is not None
    info = d.core.identity().to_proto()
    info.protocol_version = 99
    info.data_plane.backend = "mooncake"
    info.role = "prefill"
    info.rank.pp_size = 2
    lay = info.groups[0].layout
    lay.dtype, lay.num_layers, lay.head_size, lay.block_size = "fp16", 3, 128, 24
    extra = info.groups.add(name="extra")
    extra.layout.CopyFrom(info.groups[0].layout)
    async with grpc.aio.insecure_channel(p.peer_address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await peer_pb2_grpc.PeerStub(ch).Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
    assert refusal.value.code() == OK.FAILED_PRECONDITION
    details = refusal.value.details() or ""
    expected = [
        f"protocol_version: reader 99, publisher {PROTOCOL_VERSION}",
        "backend: reader mooncake, publisher nixl",
        "role: decode[tp 0/1] is a prefill-only sidecar; it does not pull",
        "pp_size: reader 2, publisher 1",
        "cache group 'extra': registered by the reader, not by the publisher",
        "group 'kv': dtype: local fp16, remote bf16",
        "group 'kv': num_layers: local 3, remote 4",
        "group 'kv': head_size: local 128, remote 64",
        "group 'kv': block_size: local 24, remote 16 (neither is a multiple of the other)",
    ]
    head = "incompatible peer: decode[tp 0/1] cannot read from prefill[tp 0/1] (local = the reader, remote = this "
    head += "sidecar): "
    assert details == head + "; ".join(expected)  # every difference, nothing else
    assert p.metrics is not None
    assert p.metrics.handshakes.labels(outcome="refused")._value.get() == 1


async def test_reader_rank_must_match_its_address(harness: Harness) -> None:
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": attention(tp=2)}, {"kv": attention(tp=1)}, prefill_tp=2, decode_tp=1
    )
    for w in pw:
        await w.prefill("r1", {"kv": [1, 2]}, salt=1)
    swapped = dw[0].client.pull("r1", [ps[1].peer_address, ps[0].peer_address], {"kv": [3, 4]})
    err = await expect_error(OK.FAILED_PRECONDITION, swapped, "does not match")
    # Both addresses are wrong; whichever answered first is reported.
    q = int(err.details[len("remote_addresses[")])
    assert err.details == (
        f"remote_addresses[{q}]: the sidecar at {ps[1 - q].peer_address} does not match: it is tp rank {1 - q}/2, "
        f"but remote_addresses[{q}] must be rank {q}/2"
    )
    wrong_engine = dw[0].client.pull("r1", [ps[0].peer_address, ps[1].peer_address], {"kv": [3, 4]},
                                     remote_engine_id="another")  # fmt: skip
    err = await expect_error(OK.FAILED_PRECONDITION, wrong_engine, "it is engine 'prefill', not 'another'")
    assert err.details.startswith("remote_addresses[")
    await dw[0].pull("r1", ps, {"kv": [3, 4]}, remote_engine_id="prefill")
    assert dw[0].verify({"kv": [3, 4]}, 1)[1] == 0


async def test_registration_errors_name_the_field_and_value(harness: Harness) -> None:
    s = await harness.sidecar()
    w = await harness.worker(s, {"kv": attention(tp=2)}, (0, 2), register=False)
    whole = SharedKVBuffer.create(LAY)
    try:
        all_heads = w.client.register_caches({"kv": (LAY, whole.ref())}, rank=RankInfo(0, 2))
        await expect_error(OK.INVALID_ARGUMENT, all_heads,
                           "groups[0].layout.num_kv_heads: rank 0/2 holds 4 of 8 heads, the layout says 8")  # fmt: skip
    finally:
        whole.close()
    await expect_error(OK.INVALID_ARGUMENT, w.client.register_caches({}), "groups: at least one cache group is needed")
    req = local_pb2.RegisterCachesRequest(rank=common_pb2.Rank(tp_rank=2, tp_size=2))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await w.client._stub.RegisterCaches(req, timeout=5)
    assert (info.value.code(), info.value.details()) == (OK.INVALID_ARGUMENT, "rank.tp_rank: 2 is not in [0, 2)")
    await expect_error(OK.FAILED_PRECONDITION, w.client.publish("r", {"kv": [1]}), "no KV caches registered")
    await w.register()  # the failures left nothing half-registered
    assert (await w.client.status())["registered"] is True


async def test_a_reader_that_registered_again_is_checked_again_before_it_reads(harness: Harness) -> None:
    """A handshake vouches for the layouts of one registration: after the decode worker registers
    other caches on the same sidecar, the publisher answers nothing until the reader handshakes again,
    and refuses it if the new layouts cannot read its blocks."""
    p, pw, d, dw = await _pair(harness)
    await transfer([pw], [p], [dw], "before", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    assert d.metrics is not None
    handshakes = d.metrics.handshakes.labels(outcome="ok")._value.get()
    # Same layouts again (a restarted vLLM with the same config): one more handshake, exact bytes.
    await dw.close()
    harness.workers.remove(dw)
    dw2 = await harness.worker(d, {"kv": LAY})
    await transfer([pw], [p], [dw2], "same", {"kv": [5]}, {"kv": [6]}, salt=2)
    assert d.metrics.handshakes.labels(outcome="ok")._value.get() == handshakes + 1
    # Another dtype: the new handshake is refused, listing the difference; nothing is read.
    await dw2.close()
    harness.workers.remove(dw2)
    other = attention(dtype="fp16")
    dw3 = await harness.worker(d, {"kv": other})
    await pw.prefill("other", {"kv": [7]}, salt=3)
    err = await expect_error(OK.FAILED_PRECONDITION, dw3.pull("other", [p], {"kv": [8]}), "dtype")
    assert err.reason.value == "INCOMPATIBLE_PEER"
    await pw.client.release("other")


async def test_get_published_from_a_stale_registration_is_refused(harness: Harness) -> None:
    """The publisher side of the same rule: a lookup that names another registration epoch than the
    reader's handshake is answered NOT_HANDSHAKEN (the reader then handshakes again)."""
    p, pw, d, dw = await _pair(harness)
    await transfer([pw], [p], [dw], "r0", {"kv": [1]}, {"kv": [2]}, salt=1)
    await pw.prefill("r1", {"kv": [3]}, salt=2)
    assert d.core is not None
    me = d.core.identity()
    async with grpc.aio.insecure_channel(p.peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        req = peer_pb2.GetPublishedRequest(request_id="r1", engine_id=me.engine_id, instance_id=me.instance_id,
                                           rank=rank_to_proto(me.rank), epoch=me.epoch + 1)  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetPublished(req, timeout=5)
        assert info.value.code() == OK.FAILED_PRECONDITION
        assert "registered again" in (info.value.details() or "")
        req.epoch = me.epoch
        resp = await stub.GetPublished(req, timeout=5)
        assert list(resp.groups[0].block_ids) == [3]
    await pw.client.release("r1")
