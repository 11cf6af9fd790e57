"""Calls built to cost a sidecar far more than they carry are refused (or slowed) without harming other work.

Each case is a way a single caller once held a sidecar's event loop, its threads or its memory:
a ``NotifyBatch`` of a million notices, a ``Handshake`` listing tens of thousands of cache groups,
a frames client that sends calls and never reads their answers, and silent connections to the
descriptor socket. Each is refused with the status and field the project's rules ask for, or
made to wait on its own connection, while an honest pull beside it succeeds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import uvloop

from kvxfer.client import AsyncClient
from kvxfer.errors import Reason
from kvxfer.fastsock import FastChannel
from kvxfer.fdpass import MAX_WAITING_HELLOS, fd_socket_path, send_fds
from kvxfer.server import fast_api
from kvxfer.server.app import Sidecar
from kvxfer.server.identity import DIFFERENCES_BYTES, MAX_GROUPS, describe_differences
from kvxfer.server.publisher import MAX_BATCH
from kvxfer.topology import RankInfo
from kvxfer.wire import local_pb2, local_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import layout_to_proto, rank_to_proto
from kvxfer.wire.frames import ANSWER, CANCEL, HELLO_CALL, PEER_HELLO, PEER_METHODS, REQUEST
from kvxfer.wire.status import error_from_status, error_from_status_message
from tests.sidecar.helpers import Harness, attention, transfer
from tests.sidecar.test_peer_frames import _framed
from tests.sidecar.test_rogue_peer import _certs

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


GET_PUBLISHED_BATCH = next(n for n, m in PEER_METHODS.items() if m.name == "GetPublishedBatch")


async def _a_client_that_never_reads(harness: Harness, tmp_path: Path, tls: bool) -> None:
    settings: dict[str, str] = {}
    client_tls = None
    if tls:
        certs = await asyncio.to_thread(_certs, tmp_path, {"engines": ["prefill", "decode"]})
        ca = str(tmp_path / "ca.pem")
        settings = {"tls_cert": certs["engines"][0], "tls_key": certs["engines"][1], "tls_ca": ca}
        client_tls = ssl.create_default_context(cafile=ca)
        client_tls.load_cert_chain(*certs["engines"])
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, **settings)
    await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    await _framed(ds[0], ps[0])
    frames = ps[0].peer_frames
    assert frames is not None
    before = frames.api.calls_by_method["GetPublishedBatch"]
    # Each call asks for 1024 requests nobody published: ~8 KB that answer over 100 KB (a refusal each).
    ask = peer_pb2.GetPublishedBatchRequest(requests=[peer_pb2.GetPublishedRequest(request_id=f"nope{i}")
                                                      for i in range(MAX_BATCH)]).SerializeToString()  # fmt: skip
    calls = 300  # over 30 MB of answers
    others = set(frames.api._connections)  # the reader's own
    reader, writer = await asyncio.open_connection("127.0.0.1", frames.port, ssl=client_tls,
                                                   server_hostname="127.0.0.1" if tls else None)  # fmt: skip
    try:
        writer.write(REQUEST.pack(len(PEER_HELLO), HELLO_CALL, 0, 0.0) + PEER_HELLO)
        n, call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
        assert (call, code) == (HELLO_CALL, 0)
        await reader.readexactly(n)
        writer.write(b"".join(REQUEST.pack(len(ask), c, GET_PUBLISHED_BATCH, 30.0) + ask for c in range(1, calls + 1)))
        (conn,) = frames.api._connections - others
        for _ in range(1000):  # until the sidecar stops reading from it (it used to read, and buffer, everything)
            if getattr(conn, "held", False) or frames.api.calls_by_method["GetPublishedBatch"] - before == calls:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # what was read before reading stopped has run
        assert conn.transport is not None
        buffered = conn.transport.get_write_buffer_size()
        started = frames.api.calls_by_method["GetPublishedBatch"] - before
        assert started < calls // 2, f"{started} of {calls} calls read; {buffered} bytes of answers buffered"
        assert buffered < 8 << 20
        # Other connections go on: the reader's own frames connection, and the pull it serves.
        (res,) = await transfer(pw, ps, dw, "r2", {"kv": [5]}, {"kv": [6]}, salt=2)
        assert res.done
        # Nothing was dropped: once the client reads, every call is answered, in order of arrival
        # (each lookup refused: under mTLS its engine id, none, is not its certificate's; else it never
        # handshook, which is told before any request is looked up).
        refused = grpc.StatusCode.PERMISSION_DENIED if tls else grpc.StatusCode.FAILED_PRECONDITION
        for c in range(1, calls + 1):
            n, call, code = ANSWER.unpack(await asyncio.wait_for(reader.readexactly(ANSWER.size), 30))
            assert (call, code) == (c, 0)
            results = peer_pb2.GetPublishedBatchResponse.FromString(await reader.readexactly(n)).results
            assert [r.code for r in results] == [refused.value[0]] * MAX_BATCH
        assert frames.api.calls_by_method["GetPublishedBatch"] - before == calls
        assert not conn.held
    finally:
        writer.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "mtls"])
async def test_a_frames_client_that_never_reads_its_answers_is_no_longer_read_from(
    harness: Harness, tmp_path: Path, tls: bool
) -> None:
    await _a_client_that_never_reads(harness, tmp_path, tls)


def test_a_frames_client_that_never_reads_its_answers_is_no_longer_read_from_under_uvloop(tmp_path: Path) -> None:
    """``kvxfer serve`` runs on uvloop, whose transports (and their flow control) are its own."""

    async def main() -> None:
        h = Harness(tmp_path)
        try:
            await _a_client_that_never_reads(h, tmp_path, tls=False)
        finally:
            await h.close()

    uvloop.run(main())


async def test_a_connection_runs_at_most_max_calls_in_flight_and_its_further_frames_wait(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fast_api, "MAX_CALLS_IN_FLIGHT", 4)
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await transfer(pw, ps, dw, "r0", {"kv": [1]}, {"kv": [2]}, salt=1)
    api = ds[0].fast_api
    assert api is not None
    before = api.calls_by_method["Pull"]
    # Push-mode pulls of requests not published yet: each runs until its publish comes.
    client = AsyncClient(ds[0].local_target, timeout=30)
    try:
        pulls = [asyncio.ensure_future(client.pull(f"q{i}", [ps[0].peer_address], {"kv": [10 + i]}, push=True))
                 for i in range(5)]  # fmt: skip
        for _ in range(500):
            if api.calls_by_method["Pull"] - before >= 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert api.calls_by_method["Pull"] - before == 4  # the fifth waits, unread, in the socket
        assert not any(p.done() for p in pulls)
        # The worker's own connection is not held up.
        (res,) = await transfer(pw, ps, dw, "r1", {"kv": [3]}, {"kv": [4]}, salt=2)
        assert res.done
        for i in range(5):
            await pw[0].prefill(f"q{i}", {"kv": [20 + i]}, salt=10 + i)
        for i, res in enumerate(await asyncio.gather(*pulls)):
            assert res.done
            assert dw[0].verify({"kv": [10 + i]}, salt=10 + i) == (res.bytes, 0)
        assert api.calls_by_method["Pull"] - before == 5 + 1
    finally:
        await client.close()


async def test_a_call_cancelled_before_it_ran_does_not_keep_its_place(harness: Harness) -> None:
    # Its place counts against MAX_CALLS_IN_FLIGHT: a call cancelled in the same read as its request
    # (its task never ran, nor the finally that forgets it) used to keep it for good.
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    frames = p.peer_frames
    assert frames is not None
    ask = peer_pb2.GetPublishedRequest(request_id="nope").SerializeToString()
    reader, writer = await asyncio.open_connection("127.0.0.1", frames.port)
    try:
        writer.write(REQUEST.pack(len(PEER_HELLO), HELLO_CALL, 0, 0.0) + PEER_HELLO)
        n, _call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
        await reader.readexactly(n)
        assert code == 0
        (conn,) = frames.api._connections
        writer.write(b"".join(REQUEST.pack(len(ask), c, 1, 5.0) + ask + REQUEST.pack(0, c, CANCEL, 0.0)
                              for c in range(1, 11)))  # fmt: skip
        for _ in range(200):
            if frames.api.calls_by_method["GetPublished"] == 10:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert frames.api.calls_by_method["GetPublished"] == 10
        assert conn.calls == {}
        # The connection still serves: a call it runs is answered (nobody registered: FAILED_PRECONDITION).
        writer.write(REQUEST.pack(len(ask), 11, 1, 5.0) + ask)
        n, call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
        assert (call, code) == (11, grpc.StatusCode.FAILED_PRECONDITION.value[0])
    finally:
        writer.close()


async def _silent_connections(harness: Harness) -> None:
    sc = await harness.sidecar(role="both")
    path = fd_socket_path(sc.local_target)
    loop = asyncio.get_running_loop()
    # More silent connections than the default executor has threads (at most 32), and than may wait.
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(MAX_WAITING_HELLOS + 8)]
    own = ThreadPoolExecutor(1)  # the worker's side, off the default executor (which is what is at stake)
    try:
        for s in silent:
            s.setblocking(False)
            await loop.sock_connect(s, str(path))
        await asyncio.sleep(0.2)  # all accepted
        # Each used to hold a thread of the default executor for up to 10 s, which the streamer's GPU
        # event waits (and every other to_thread) share.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 5) == "ran"
        # A worker's hand-over, descriptors and all, is answered at once (it waits 5 s at most here).
        memory = os.memfd_create("kvxfer-test")
        try:
            os.ftruncate(memory, 8192)
            lease = await loop.run_in_executor(own, functools.partial(send_fds, path, [memory], timeout=5))
        finally:
            os.close(memory)
        assert lease.sizes == (8192,)
        assert sc.fd_box is not None
        assert sc.fd_box.fds(lease.handle)[1] == (8192,)
        lease.close()
        # The connections that waited longest were closed, each told why.
        evicted = 0
        for s in silent:
            try:
                got = s.recv(4096)
            except BlockingIOError:
                continue  # still waiting
            evicted += 1
            assert json.loads(got) == {
                "error": f"too many connections ({MAX_WAITING_HELLOS}) are waiting to say hello on the descriptor "
                "socket; this one waited longest and is closed (say hello as you connect, then retry)",
                "code": "RESOURCE_EXHAUSTED",
            }
            assert s.recv(4096) == b""  # and closed
        # 8 beyond the limit; one more when the worker's connection was accepted before its hello arrived
        # (it then waited, 33rd, and pushed the oldest silent one out before saying hello).
        assert evicted in (8, 9)
    finally:
        own.shutdown(wait=False)
        for s in silent:
            s.close()


async def test_silent_connections_to_the_descriptor_socket_delay_no_workers_hand_over(harness: Harness) -> None:
    await _silent_connections(harness)


def test_silent_connections_to_the_descriptor_socket_delay_no_workers_hand_over_under_uvloop(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        try:
            await _silent_connections(h)
        finally:
            await h.close()

    uvloop.run(main())
