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
from kvxfer.server.publisher import MAX_BATCH
from kvxfer.wire import peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import rank_to_proto
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
