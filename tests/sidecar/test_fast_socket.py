"""The local fast socket (``<socket>.fast``): the hot calls as frames, with gRPC's behaviour and gRPC as fallback.

What a worker sees must not depend on the channel: the same bytes, the same errors (code, message,
reason, field), the same deadlines and the same credentials; a sidecar without the socket is
served over gRPC; a frame the sidecar cannot use fails only its own call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from kvxfer.client import AsyncClient, Client, KvxferRpcError, PullItem, PullResult
from kvxfer.errors import Reason
from kvxfer.server.app import Sidecar
from kvxfer.wire import local_pb2
from kvxfer.wire.convert import blocks_to_proto
from kvxfer.wire.frames import ANSWER, HELLO, REQUEST, fast_socket_path
from kvxfer.wire.status import error_from_status_message
from tests.sidecar.helpers import DelayedDataPlane, Harness, attention, transfer

LAY = attention()
PULL = 1


async def _failure(coro: Awaitable[Any]) -> KvxferRpcError:
    with pytest.raises(KvxferRpcError) as info:
        await coro
    return info.value


def _same(a: KvxferRpcError, b: KvxferRpcError) -> None:
    assert (a.code, a.details, a.reason, a.field, a.method) == (b.code, b.details, b.reason, b.field, b.method)


async def test_a_pull_over_the_fast_socket_moves_exact_bytes(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    assert not dw[0].client.fast_active  # connected on the first hot call, not before
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [5, 6, 7, 30]}, {"kv": [9, 3, 4, 50]}, salt=11)
    assert res.done
    assert res.bytes == 4 * LAY.page_bytes * LAY.num_layers
    assert dw[0].client.fast_active
    assert pw[0].client.fast_active
    # PullBatch too, each item byte-exact.
    await pw[0].prefill("b1", {"kv": [1, 2]}, salt=12)
    await pw[0].prefill("b2", {"kv": [3]}, salt=13)
    dw[0].poison({"kv": [10, 11, 12]})
    out = await dw[0].client.pull_batch([
        PullItem("b1", [ps[0].peer_address], {"kv": [10, 11]}), PullItem("b2", [ps[0].peer_address], {"kv": [12]}),
    ])  # fmt: skip
    assert all(isinstance(r, PullResult) and r.done for r in out)
    assert ds[0].fast_api is not None
    assert ds[0].fast_api.calls_started == 2  # the Pull and the PullBatch came as frames
    assert dw[0].verify({"kv": [10, 11]}, salt=12)[1] == 0
    assert dw[0].verify({"kv": [12]}, salt=13)[1] == 0


async def test_a_waiting_pull_is_answered_before_its_bookkeeping_runs(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvxfer.server import fast_api
    from kvxfer.server.puller import Puller

    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    events: list[str] = []
    answer, pulled = fast_api._Connection._answer, Puller._pulled

    def answering(self: Any, call: int, outcome: Any, payload: bytes) -> None:
        if call != 0 and self.api.path is not None:  # the worker's fast socket (not a peer's frames), not a hello
            events.append("answer")
        answer(self, call, outcome, payload)

    def booking(self: Any, entry: Any, stats: Any, elapsed: float) -> None:
        events.append(f"booked {entry.request_id}")
        pulled(self, entry, stats, elapsed)

    monkeypatch.setattr(fast_api._Connection, "_answer", answering)
    monkeypatch.setattr(Puller, "_pulled", booking)
    for rid, wait in (("r1", True), ("r2", False)):
        await pw[0].prefill(rid, {"kv": [1, 2]}, salt=3)
        events.clear()
        res = await dw[0].pull(rid, ps, {"kv": [4, 5]}, wait=wait)
        for _ in range(100):  # the bookkeeping of a pull nobody waits for comes when it ends
            if f"booked {rid}" in events:
                break
            await asyncio.sleep(0.01)
        if wait:
            # Metrics, the completion event and the publisher's notice come after the worker's
            # answer (they came first before: the waiting side is one loop turn later), and once.
            assert events == ["answer", f"booked {rid}"]
        else:  # answered when posted: booked once, by the pull itself
            assert sorted(events) == ["answer", f"booked {rid}"], res.done
    assert dw[0].verify({"kv": [4, 5]}, salt=3)[1] == 0


async def test_the_blocking_clients_own_thread_calls_keep_their_deadlines(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=DelayedDataPlane("decode-slow", 0.5))
    pw = await harness.worker(p, {"kv": LAY})
    dw = await harness.worker(d, {"kv": LAY})
    assert d.fast_api is not None
    with Client(d.local_target) as blocking, Client(p.local_target) as publisher:

        def calls() -> tuple[KvxferRpcError, PullResult]:
            publisher.publish("slow", {"kv": [1]})
            publisher.publish("next", {"kv": [2]})
            with pytest.raises(KvxferRpcError) as late:
                blocking.pull("slow", [p.peer_address], {"kv": [3]}, deadline=0.2)
            # The sidecar was told to drop the abandoned pull; the thread's connection serves the next call.
            return late.value, blocking.pull("next", [p.peer_address], {"kv": [4]}, deadline=5.0)

        pw.fill({"kv": [1]}, salt=6)
        pw.fill({"kv": [2]}, salt=7)
        dw.poison({"kv": [3, 4]})
        late, res = await asyncio.to_thread(calls)
        assert (late.code, late.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.DEADLINE)
        assert (res.request_id, res.done, res.bytes) == ("next", True, LAY.page_bytes * LAY.num_layers)
        assert dw.verify({"kv": [4]}, salt=7)[1] == 0
        assert blocking.fast_active
        assert not blocking.aio.fast_active  # nothing went through the facade's loop thread
        assert d.fast_api.calls_started == 2
        # A thread that ends takes its connection with it.
        import gc
        import threading

        open_in_thread: list[int] = []

        def one_call() -> None:
            with pytest.raises(KvxferRpcError):  # never published: NOT_FOUND, over this thread's connection
                blocking.pull("gone", [p.peer_address], {"kv": [5]})
            open_in_thread.append(len(blocking._thread_calls._open))

        def in_a_thread_that_ends() -> None:
            t = threading.Thread(target=one_call)
            t.start()
            t.join()

        before = len(d.fast_api._connections)
        await asyncio.to_thread(in_a_thread_that_ends)
        gc.collect()
        assert open_in_thread == [2]  # the pool thread's connection and the new thread's
        for _ in range(100):
            if len(d.fast_api._connections) == before:
                break
            await asyncio.sleep(0.01)
        assert len(blocking._thread_calls._open) == 1
        assert len(d.fast_api._connections) == before  # the sidecar saw the ended thread's connection close


async def test_errors_are_the_same_as_over_grpc(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw = await harness.worker(p, {"kv": LAY})
    dw = await harness.worker(d, {"kv": LAY})
    slow_p, slow_d = AsyncClient(p.local_target, fast=False), AsyncClient(d.local_target, fast=False)
    try:
        cases = [
            (lambda c: c.pull("missing", [p.peer_address], {"kv": [1]}), dw.client, slow_d),  # NOT_PUBLISHED
            (lambda c: c.publish("r1", {"kv": [1]}), dw.client, slow_d),  # WRONG_ROLE
            (lambda c: c.publish("r2", {"kv": [LAY.num_blocks]}), pw.client, slow_p),  # INVALID_FIELD, blocks[kv]
            (lambda c: c.pull("", [p.peer_address], {"kv": [1]}), dw.client, slow_d),  # request_id
            (lambda c: c.pull("r3", [p.peer_address], {"kv": [1]}, deadline=math.nan), dw.client, slow_d),
            (lambda c: c.pull_batch([]), dw.client, slow_d),  # an empty batch
        ]
        for call, fast, slow in cases:
            got, want = await _failure(call(fast)), await _failure(call(slow))
            _same(got, want)
            assert got.reason is not Reason.INTERNAL
        assert dw.client.fast_active
        assert pw.client.fast_active
    finally:
        await slow_p.close()
        await slow_d.close()


async def test_a_pull_past_its_deadline_fails_as_over_grpc(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=DelayedDataPlane("decode-slow", 3.0))
    pw = await harness.worker(p, {"kv": LAY})
    dw = await harness.worker(d, {"kv": LAY})
    slow = AsyncClient(d.local_target, fast=False)
    try:
        errors = []
        for i, client in enumerate((dw.client, slow)):
            await pw.prefill(f"d{i}", {"kv": [1]}, salt=1)
            errors.append(await _failure(client.pull(f"d{i}", [p.peer_address], {"kv": [2]}, deadline=0.3)))
        got, want = errors
        assert got.code == want.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got.reason == want.reason == Reason.DEADLINE
        assert dw.client.fast_active
        # The sidecar dropped the pull: nothing is left in flight.
        for _ in range(100):
            if (await dw.client.status())["transfers_in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await dw.client.status())["transfers_in_flight"] == 0
    finally:
        await slow.close()


async def test_without_the_fast_socket_the_client_uses_grpc(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, fast_socket=False)
    assert not fast_socket_path(ds[0].settings.local_socket).exists()
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=21)
    assert res.done
    assert not dw[0].client.fast_active
    assert not pw[0].client.fast_active
    err = await _failure(dw[0].client.pull("missing", [ps[0].peer_address], {"kv": [1]}))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, Reason.NOT_PUBLISHED)


async def test_the_fast_socket_has_the_local_sockets_mode_and_token(
    harness: Harness, token_file: Callable[[str], str]
) -> None:
    tf = token_file("s3cret")
    d = await harness.sidecar(role="decode", engine_id="decode", token_file=tf)
    path = fast_socket_path(d.settings.local_socket)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    good = await harness.worker(d, {"kv": LAY}, token="s3cret")
    err = await _failure(good.client.pull("missing", ["127.0.0.1:1"], {"kv": [1]}))
    assert err.reason is not Reason.UNAUTHENTICATED
    assert good.client.fast_active
    # A wrong token: the hello is refused, and the call fails over gRPC with gRPC's refusal.
    bad, slow = AsyncClient(d.local_target, token="nope"), AsyncClient(d.local_target, token="nope", fast=False)
    try:
        got = await _failure(bad.pull("r", ["127.0.0.1:1"], {"kv": [1]}))
        _same(got, await _failure(slow.pull("r", ["127.0.0.1:1"], {"kv": [1]})))
        assert (got.code, got.reason) == (grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED)
        assert not bad.fast_active
    finally:
        await bad.close()
        await slow.close()
    reader, writer = await _raw(d, token="nope")
    code, status = await _read_answer(reader)
    assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert error_from_status_message(status)[2:] == (Reason.UNAUTHENTICATED, "authorization")
    assert await reader.read() == b""  # and the connection is closed
    writer.close()


async def test_a_malformed_frame_is_refused_without_harming_other_calls(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await pw[0].prefill("ok", {"kv": [1, 2]}, salt=31)
    reader, writer = await _raw(ds[0])
    assert await _read_answer(reader) == (0, b"")  # hello answered
    # Not a PullRequest: INVALID_ARGUMENT naming the message, as gRPC answers it.
    writer.write(REQUEST.pack(3, 7, PULL, 5.0) + b"\xff\xff\xff")
    # A method the socket does not carry; a NaN deadline.
    writer.write(REQUEST.pack(0, 8, 99, 5.0))
    req = local_pb2.PullRequest(
        request_id="ok", remote_addresses=[ps[0].peer_address], local_blocks=blocks_to_proto({"kv": [5, 6]}), wait=True
    )
    good = req.SerializeToString()
    writer.write(REQUEST.pack(len(good), 9, PULL, math.nan) + good)
    answers = {}
    for _ in range(3):
        n, call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
        answers[call] = (code, error_from_status_message(await reader.readexactly(n)))
    assert answers[7][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[7][1][2:] == (Reason.INVALID_FIELD, "request")
    assert "malformed kvxfer.v1.PullRequest" in answers[7][1][1]
    assert answers[8][0] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert answers[9][1][2:] == (Reason.INVALID_FIELD, "deadline")
    # The same connection still serves a good call, and other clients never noticed.
    writer.write(REQUEST.pack(len(good), 10, PULL, 5.0) + good)
    n, call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
    assert (call, code) == (10, 0)
    assert local_pb2.PullResponse.FromString(await reader.readexactly(n)).done
    assert dw[0].verify({"kv": [5, 6]}, salt=31)[1] == 0
    # A frame over --max-message-bytes: refused and that connection closed; no other is touched.
    writer.write(REQUEST.pack(2**31, 11, PULL, 5.0))
    n, call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
    assert (call, code) == (11, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    await reader.readexactly(n)
    assert await reader.read() == b""
    writer.close()
    # Garbage before any hello: refused and closed.
    r2, w2 = await asyncio.open_unix_connection(str(fast_socket_path(ds[0].settings.local_socket)))
    w2.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await r2.read())[ANSWER.size :]  # an error status, then EOF
    w2.close()
    (res,) = await transfer(pw, ps, dw, "after", {"kv": [3]}, {"kv": [7]}, salt=32)
    assert res.done
    assert dw[0].client.fast_active


async def test_a_sidecar_restart_reconnects_or_falls_back(harness: Harness) -> None:
    d = await harness.sidecar(role="decode", engine_id="decode")
    client = AsyncClient(d.local_target)
    try:
        err = await _failure(client.pull("r", ["127.0.0.1:1"], {"kv": [1]}))  # not registered yet
        assert err.reason is Reason.NOT_REGISTERED
        assert client.fast_active
        assert d.fast_api is not None
        await d.fast_api.close()  # the socket goes away and the connection drops
        for _ in range(50):
            if not client.fast_active:
                break
            await asyncio.sleep(0.02)
        # The next hot call goes over gRPC (the fast socket is gone), with the same answer.
        err2 = await _failure(client.pull("r", ["127.0.0.1:1"], {"kv": [1]}))
        _same(err, err2)
        assert not client.fast_active
    finally:
        await client.close()


async def _raw(sc: Sidecar, token: str = "") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the fast socket that has sent its hello."""
    reader, writer = await asyncio.open_unix_connection(str(fast_socket_path(sc.settings.local_socket)))
    hello = HELLO + token.encode()
    writer.write(REQUEST.pack(len(hello), 0, 0, 0.0) + hello)
    return reader, writer


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    n, _call, code = ANSWER.unpack(await reader.readexactly(ANSWER.size))
    return code, await reader.readexactly(n)


def test_frame_headers_are_fixed() -> None:
    # Both sides of a deployment may be different builds: the layout is part of the contract.
    assert REQUEST.size == 17
    assert ANSWER.size == 9
    assert struct.calcsize("<IIBd") == REQUEST.size


def test_the_fast_socket_under_uvloop(tmp_path: Path) -> None:
    """``kvxfer serve`` and the blocking client both run on uvloop, whose transports differ from asyncio's."""

    async def main() -> None:
        h = Harness(tmp_path)
        try:
            d = await h.sidecar(role="decode", engine_id="decode")
            client = AsyncClient(d.local_target)
            try:
                err = await _failure(client.pull("r", ["127.0.0.1:1"], {"kv": [1]}))
                assert err.reason is Reason.NOT_REGISTERED
                assert client.fast_active
            finally:
                await client.close()
            # The blocking facade: its pull goes from the calling thread over that thread's own
            # connection, not through the facade's uvloop thread.
            with Client(d.local_target) as blocking:
                with pytest.raises(KvxferRpcError) as info:
                    await asyncio.to_thread(blocking.pull, "r", ["127.0.0.1:1"], {"kv": [1]})
                assert info.value.reason is Reason.NOT_REGISTERED
                assert blocking.fast_active
                assert not blocking.aio.fast_active
            assert d.fast_api is not None
            assert d.fast_api.calls_started == 2
        finally:
            await h.close()

    uvloop.run(main())


async def test_expect_goes_over_the_fast_socket_and_its_pull_reads_on_the_grant(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    d = ds[0]
    assert d.fast_api is not None
    assert d.core is not None
    await pw[0].prefill("e1", {"kv": [1, 2]}, salt=3)
    started = d.fast_api.calls_started
    assert await dw[0].client.expect("e1", [ps[0].peer_address]) is True
    assert d.fast_api.calls_started == started + 1  # a frame, not a gRPC call
    assert await dw[0].client.expect("e1", [ps[0].peer_address]) is False  # already expected, as over gRPC
    assert d.fast_api.calls_started == started + 2
    for _ in range(500):  # the first hold goes out at once
        if "e1" in d.core.holds.grants:
            break
        await asyncio.sleep(0.01)
    res = await dw[0].pull("e1", ps, {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]})
    assert dw[0].verify({"kv": [5, 6]}, 3) == (res.bytes, 0)
    assert res.fetch_seconds == 0.0  # read on the grant the Expect's hold brought
    # Bad input fails the same way as over gRPC: the code, the field, and the next call unharmed.
    with pytest.raises(KvxferRpcError) as info:
        await dw[0].client.expect("", [ps[0].peer_address])
    assert (info.value.code, info.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    assert d.fast_api.calls_started == started + 4
    assert await dw[0].client.expect("e2", [ps[0].peer_address]) is True


async def _until(done: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


async def test_a_quiet_expect_is_answered_only_when_it_fails(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    d, client, peer = ds[0], dw[0].client, ps[0].peer_address
    assert d.fast_api is not None
    assert d.core is not None
    await pw[0].prefill("q1", {"kv": [1, 2]}, salt=5)
    await pw[0].prefill("q3", {"kv": [3]}, salt=6)
    await client.status()
    started = d.fast_api.calls_started
    await client.expect_quietly("q1", [peer])  # returns once written: nothing to wait for
    channel = client._fast
    assert channel is not None
    (call,) = channel._quiet  # remembered, in case its failure comes
    await _until(lambda: "q1" in d.core.holds.grants, "the quiet Expect's hold brought a grant")
    assert d.fast_api.calls_started == started + 1  # one frame, method 11
    # An answered call after it: answers leave in the order calls end, so had the quiet one been
    # answered, its answer would have been read by now.
    assert await client.expect("q0", [peer]) is True
    assert call in channel._quiet
    assert client.quiet_failures == 0
    res = await dw[0].pull("q1", ps, {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]})
    assert dw[0].verify({"kv": [5, 6]}, 5) == (res.bytes, 0)
    assert res.fetch_seconds == 0.0  # read on the grant, as after an answered Expect
    # Bad input: the failure is answered; the client logs and counts it, naming the field.
    with caplog.at_level(logging.WARNING):
        await client.expect_quietly("", [peer])
        await _until(lambda: client.quiet_failures == 1, "the quiet failure was heard")
    failure = client.last_quiet_failure
    assert failure is not None
    assert (failure.code, failure.field, failure.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id",
        Reason.INVALID_FIELD.value,
    )
    assert list(channel._quiet) == [call]  # the failed one was reported; the one that succeeded is never answered
    client_logs = [r for r in caplog.records if r.name == "kvxfer.client" and "Expect of request ''" in r.getMessage()]
    assert len(client_logs) == 1
    sidecar_logs = [r for r in caplog.records if r.getMessage() == "quiet call failed"]
    assert [getattr(r, "field", None) for r in sidecar_logs] == ["request_id"]
    # The connection and the next calls are unharmed.
    assert await client.expect("q2", [peer]) is True
    await client.expect_quietly("q3", [peer])
    await _until(lambda: "q3" in d.core.holds.grants, "the next quiet Expect held its request")
    assert client.quiet_failures == 1


async def test_an_expect_that_comes_after_its_pull_holds_nothing(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    d = ds[0]
    assert d.core is not None
    (res,) = await transfer(pw, ps, dw, "late", {"kv": [1]}, {"kv": [2]}, salt=4)
    assert res.done
    # The scheduler's connection is not the worker's: its Expect may arrive after the pull ended.
    assert await dw[0].client.expect("late", [ps[0].peer_address]) is False
    assert "late" not in d.core.holds.expected


async def test_a_quiet_expect_to_an_older_sidecar_is_sent_awaited(harness: Harness) -> None:
    ps, pw, ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    d = ds[0]
    assert d.fast_api is not None
    assert d.core is not None
    d.fast_api.methods.pop(11)  # FAULT INJECTOR: a sidecar from before quiet calls
    await pw[0].prefill("o1", {"kv": [1]}, salt=1)
    await pw[0].prefill("o2", {"kv": [2]}, salt=1)
    client = AsyncClient(d.local_target)
    try:
        await client.expect_quietly("o1", [ps[0].peer_address])  # refused as method 11, then Expect awaited
        await _until(lambda: "o1" in d.core.holds.expected, "the refused quiet Expect went again, awaited")
        assert client._fast_refused == {11}
        assert client.quiet_failures == 0  # nothing failed: the refusal is not the Expect's failure
        started = d.fast_api.calls_started
        await client.expect_quietly("o2", [ps[0].peer_address])  # awaited at once, as method 8
        assert "o2" in d.core.holds.expected
        assert d.fast_api.calls_started == started + 1
    finally:
        await client.close()


async def test_a_quiet_expect_without_the_fast_socket_is_awaited_and_raises(harness: Harness) -> None:
    ps, pw, ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    d = ds[0]
    assert d.core is not None
    await pw[0].prefill("g1", {"kv": [1]}, salt=1)
    client = AsyncClient(d.local_target, fast=False)
    try:
        await client.expect_quietly("g1", [ps[0].peer_address])
        assert "g1" in d.core.holds.expected  # awaited: held by the time it returns
        failure = await _failure(client.expect_quietly("g2", []))
        assert (failure.code, failure.field) == (grpc.StatusCode.INVALID_ARGUMENT, "remote_addresses")
    finally:
        await client.close()


async def test_a_method_an_older_sidecars_fast_socket_lacks_goes_over_grpc(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, _dw = await harness.deployment({"kv": lay}, {"kv": lay})
    d = ds[0]
    assert d.fast_api is not None
    d.fast_api.methods.pop(8)  # FAULT INJECTOR: a sidecar from before Expect was a frame
    await pw[0].prefill("e1", {"kv": [1]}, salt=1)
    started = d.fast_api.calls_started
    client = AsyncClient(d.local_target)
    try:
        await client.status()  # connected over gRPC; the fast socket opens with the first hot call
        assert await client.expect("e1", [ps[0].peer_address]) is True  # refused as a frame, then gRPC
        assert await client.expect("e1", [ps[0].peer_address]) is False  # gRPC at once, same answer
        assert client._fast_refused == {8}
        assert d.fast_api.calls_started == started  # nothing ran as a frame
        res = await client.pull("e1", [ps[0].peer_address], {"kv": [2]})  # the other hot calls keep the socket
        assert res.bytes == lay.page_bytes * lay.num_layers
        assert d.fast_api.calls_started == started + 1
    finally:
        await client.close()


@pytest.mark.parametrize("answer_after_s", [0.0, 0.15], ids=["within-the-spin", "after-the-spin"])
def test_a_blocking_call_runs_its_hook_once_sent_and_polls_for_the_answer(answer_after_s: float) -> None:
    """``while_waiting`` runs once the request is on the socket; the answer is read whether it comes
    while the thread polls (``spin_s``) or later, when it blocks. The peer is the test's own socket."""
    import socket
    import threading
    import time

    from kvxfer.fastsock import BlockingFastConnection

    mine, theirs = socket.socketpair()
    conn = BlockingFastConnection(mine, 1 << 20)
    seen: list[bytes] = []

    def answer_later(call: int) -> None:
        time.sleep(answer_after_s)
        theirs.sendall(ANSWER.pack(5, call, 0) + b"hello")

    def hook() -> None:
        theirs.settimeout(1.0)
        frame = theirs.recv(REQUEST.size + 3)  # the request is there already: sent before the hook ran
        seen.append(frame)
        n, call, method, _timeout = REQUEST.unpack_from(frame, 0)
        assert (n, method, frame[REQUEST.size :]) == (3, PULL, b"req")
        threading.Thread(target=answer_later, args=(call,)).start()

    try:
        t0 = time.monotonic()
        code, body = conn.call(PULL, b"req", 5.0, while_waiting=hook, spin_s=0.05)
        assert (code, body) == (0, b"hello")
        assert len(seen) == 1
        assert time.monotonic() - t0 >= answer_after_s
        # Read while polling (the socket left non-blocking), or by the blocking wait after the spin.
        assert (mine.gettimeout() == 0.0) == (answer_after_s == 0.0)
        # The connection serves the next call as usual (blocking, no hook).
        threading.Thread(target=lambda: (theirs.recv(REQUEST.size + 2),
                                         theirs.sendall(ANSWER.pack(2, 2, 0) + b"ok"))).start()  # fmt: skip
        assert conn.call(PULL, b"r2", 5.0) == (0, b"ok")
    finally:
        conn.close()
        theirs.close()


async def test_a_fast_call_past_its_deadline_raises_and_tells_the_sidecar_to_abandon_it(tmp_path: Path) -> None:
    """The channel's own timer (no sidecar deadline involved): a frames server that answers the hello
    and then only the calls it is told to."""
    from kvxfer.fastsock import FastChannel
    from kvxfer.wire.frames import CANCEL

    frames: list[tuple[int, int, bytes]] = []  # (call, method, payload) as the server read them
    answer_from = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readexactly(REQUEST.size)
            except asyncio.IncompleteReadError:
                return
            n, call, method, _ = REQUEST.unpack(head)
            payload = await reader.readexactly(n)
            frames.append((call, method, payload))
            if call == 0 or (answer_from.is_set() and method != CANCEL):
                writer.write(ANSWER.pack(2, call, 0) + b"ok")

    path = tmp_path / "frames.sock"
    server = await asyncio.start_unix_server(serve, path=str(path))
    ch = await FastChannel.open(path, token=None, timeout=5.0, max_message_bytes=1 << 20)
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await ch.call(3, b"slow", 0.2)
        took = asyncio.get_running_loop().time() - t0
        assert 0.2 <= took < 2.0
        for _ in range(100):  # the abandon frame follows the timeout
            if len(frames) == 3:
                break
            await asyncio.sleep(0.01)
        (_, hello, _), (call, method, payload), cancel = frames
        assert hello == 0
        assert (method, payload) == (3, b"slow")
        assert cancel == (call, CANCEL, b"")
        assert not ch._waiting  # nothing left waiting for the lost answer
        answer_from.set()
        assert await ch.call(3, b"next", 5.0) == (0, b"ok")  # the connection is unharmed
    finally:
        ch.close()
        server.close()
        await server.wait_closed()
