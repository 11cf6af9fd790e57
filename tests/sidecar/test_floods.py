"""Calls built to cost a sidecar far more than they carry are refused (or slowed) without harming other work.

Each case is a way a single caller once held a sidecar's event loop, its threads or its memory:
a ``NotifyBatch`` of a million notices, a ``Handshake`` listing tens of thousands of cache groups,
a frames client that sends calls and never reads their answers, and silent connections to the
descriptor socket. Each is refused with the status and field the project's rules ask for, or
made to wait on its own connection, while an honest pull beside it succeeds.
"""

from __future__ import annotations

import grpc
import pytest

from kvxfer.errors import Reason
from kvxfer.fastsock import FastChannel
from kvxfer.server.app import Sidecar
from kvxfer.server.identity import DIFFERENCES_BYTES, MAX_GROUPS, describe_differences
from kvxfer.server.publisher import MAX_BATCH
from kvxfer.topology import RankInfo
from kvxfer.wire import local_pb2, local_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import layout_to_proto, rank_to_proto
from kvxfer.wire.frames import PEER_HELLO, PEER_METHODS
from kvxfer.wire.status import error_from_status, error_from_status_message
from tests.sidecar.helpers import Harness, attention, transfer
from tests.sidecar.test_peer_frames import _framed

LAY = attention()
NOTIFY_BATCH = next(n for n, m in PEER_METHODS.items() if m.name == "NotifyBatch")


def _notices(reader: Sidecar, n: int) -> peer_pb2.NotifyBatchRequest:
    """``n`` DONE notices from ``reader`` for requests it never fetched (each one refused on its own)."""
    assert reader.core is not None
    me = reader.core.identity()
    notice = peer_pb2.NotifyRequest(request_id="never-fetched", engine_id=me.engine_id, instance_id=me.instance_id,
                                    rank=rank_to_proto(me.rank), outcome=peer_pb2.NotifyRequest.DONE)  # fmt: skip
    return peer_pb2.NotifyBatchRequest(notices=[notice] * n)


async def test_a_notify_batch_over_max_batch_is_refused_whole_over_grpc_and_frames(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)  # the reader handshook
    await _framed(ds[0], ps[0])
    expected = f"notices: {MAX_BATCH + 1} notices in one NotifyBatch; at most {MAX_BATCH}"
    async with grpc.aio.insecure_channel(ps[0].peer_address) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        # At the limit: each notice is worked through (and refused on its own: none was fetched).
        assert (await stub.NotifyBatch(_notices(ds[0], MAX_BATCH), timeout=10)).released == 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.NotifyBatch(_notices(ds[0], MAX_BATCH + 1), timeout=10)
    exc = info.value
    assert (exc.code(), exc.details()) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
    assert error_from_status(exc.code(), exc.details() or "", exc.trailing_metadata()) == (
        Reason.INVALID_FIELD, "notices")  # fmt: skip

    # The peer frames path runs the same servicer method: the same refusal.
    assert ps[0].peer_frames is not None
    ch = await FastChannel.open_tcp("127.0.0.1", ps[0].peer_frames.port, tls=None, hello=PEER_HELLO, token=None,
                                    timeout=5, max_message_bytes=64 << 20)  # fmt: skip
    try:
        code, body = await ch.call(NOTIFY_BATCH, _notices(ds[0], MAX_BATCH + 1).SerializeToString(), 10)
    finally:
        ch.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error_from_status_message(body) == (
        grpc.StatusCode.INVALID_ARGUMENT, expected, Reason.INVALID_FIELD, "notices")  # fmt: skip

    # Other transfers never noticed.
    (res,) = await transfer(pw, ps, dw, "r2", {"kv": [5]}, {"kv": [6]}, salt=2)
    assert res.done


def _reader_info(reader: Sidecar, extra_groups: list[str]) -> peer_pb2.PeerInfo:
    """``reader``'s handshake (another instance of it) naming ``extra_groups`` besides its own."""
    assert reader.core is not None
    info = reader.core.identity().to_proto()
    info.instance_id = "flood-reader"
    layout = info.groups[0].layout
    info.groups.extend(peer_pb2.GroupLayout(name=n, layout=layout) for n in extra_groups)
    return info


async def _handshake_error(publisher: Sidecar, info: peer_pb2.PeerInfo) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(publisher.peer_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer_pb2_grpc.PeerStub(channel).Handshake(peer_pb2.HandshakeRequest(info=info), timeout=30)
    return err.value


async def test_a_handshake_with_more_cache_groups_than_max_groups_is_refused_before_any_is_looked_at(
    harness: Harness,
) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    # Tens of thousands of groups once held the publisher's loop for seconds (their differences were
    # deduplicated in quadratic time), and were then refused RESOURCE_EXHAUSTED: the message listing
    # every one of them overflowed gRPC's trailing metadata.
    exc = await _handshake_error(ps[0], _reader_info(ds[0], [f"g{i}" for i in range(40_000)]))
    assert (exc.code(), exc.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"info.groups: 40001 cache groups; at most {MAX_GROUPS}")  # fmt: skip
    assert error_from_status(exc.code(), "", exc.trailing_metadata()) == (Reason.INVALID_FIELD, "info.groups")
    exc = await _handshake_error(ps[0], _reader_info(ds[0], [f"g{i}" for i in range(MAX_GROUPS)]))
    assert exc.details() == f"info.groups: {MAX_GROUPS + 1} cache groups; at most {MAX_GROUPS}"
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    assert res.done


async def test_a_refused_handshake_lists_the_first_differences_and_counts_the_rest(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    names = [f"{i:03d}-" + "x" * 500 for i in range(MAX_GROUPS - 1)]  # as many as allowed, long names
    exc = await _handshake_error(ps[0], _reader_info(ds[0], names))
    # FAILED_PRECONDITION, as for any incompatible reader: not RESOURCE_EXHAUSTED from a message too
    # long for gRPC's metadata.
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
    assert error_from_status(exc.code(), "", exc.trailing_metadata()) == (Reason.INCOMPATIBLE_PEER, "info")
    assert ps[0].core is not None
    assert exc.details() == (
        f"incompatible peer: decode[tp 0/1] cannot read from {ps[0].core.identity().label} (local = the reader, "
        f"remote = this sidecar): cache group {names[0]!r}: registered by the reader, not by the publisher; "
        f"and {MAX_GROUPS - 2} more differences"
    )
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    assert res.done


def test_differences_are_listed_up_to_their_budget_and_counted_beyond() -> None:
    assert describe_differences(["a: 1", "b: 2"]) == "a: 1; b: 2"
    assert describe_differences(["a: 1", "b: 2", "c: 3"], budget=12) == "a: 1; b: 2; and 1 more difference"
    assert describe_differences(["x" * 50, "y"], budget=10) == "x" * 10 + "...; and 1 more difference"
    many = [f"group {i}: dtype: local fp16, remote bf16" for i in range(10_000)]
    text = describe_differences(many)
    assert len(text.encode()) < DIFFERENCES_BYTES + 40
    assert text.endswith(f"; and {10_000 - text.count('group ')} more differences")


async def test_a_registration_of_more_cache_groups_than_max_groups_is_refused(harness: Harness) -> None:
    sc = await harness.sidecar(role="both")
    groups = [local_pb2.CacheGroup(name=f"g{i}", layout=layout_to_proto(LAY)) for i in range(MAX_GROUPS + 1)]
    req = local_pb2.RegisterCachesRequest(worker_id="w", rank=rank_to_proto(RankInfo(0, 1)), groups=groups)
    async with grpc.aio.insecure_channel(sc.local_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await local_pb2_grpc.LocalStub(channel).RegisterCaches(req, timeout=10)
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"groups: {MAX_GROUPS + 1} cache groups; at most {MAX_GROUPS}")  # fmt: skip
