"""The peer API's hot calls as frames between sidecars (kvxfer.server.peer_frames): used, exact, and no weaker.

Lookups, notices and holds go as frames once a reader's frames connection to its publisher is open;
the connection carries the peer API's credentials (token in the hello, TLS with the same
certificates, the client certificate's engine names for every call on it), and a reader uses only
a frames address on the host it dialed. A connection that goes away leaves the calls to gRPC.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from pathlib import Path

import grpc
import pytest

from kvxfer.errors import KvxferError
from kvxfer.fastsock import FastCallError, FastChannel, FastHelloRefusedError
from kvxfer.server import fast_api
from kvxfer.server.app import Sidecar
from kvxfer.server.peer_frames import FramesDialer, same_host
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import rank_to_proto
from kvxfer.wire.frames import PEER_HELLO
from kvxfer.wire.status import error_from_status_message
from tests.sidecar.helpers import Harness, Worker, attention
from tests.sidecar.test_rogue_peer import SECRET, _certs

LAY = attention()


async def _framed(reader: Sidecar, publisher: Sidecar) -> None:
    """Until the reader's frames connection to the publisher (opened after the handshake) is up."""
    assert reader.core is not None
    for _ in range(500):
        if reader.core.peers.framed(publisher.peer_address):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no frames connection within 5 s")


def _frames_calls(s: Sidecar) -> Counter[str]:
    """The calls that reached ``s`` as frames so far, by method."""
    assert s.peer_frames is not None
    return Counter(s.peer_frames.api.calls_by_method)


async def _freed(w: Worker) -> None:
    """Until the publisher holds nothing (the reader's DONE notice lingers a few ms, then frees it)."""
    for _ in range(300):
        if (await w.client.status())["leases"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a publish is still held")


@pytest.mark.parametrize("auth", ["none", "token", "mtls"])
async def test_a_pulls_lookup_and_notice_go_as_frames_and_move_exact_bytes(
    harness: Harness, tmp_path: Path, auth: str
) -> None:
    settings: dict[str, str] = {}
    if auth == "token":
        (tmp_path / "token").write_text(SECRET)
        settings["token_file"] = str(tmp_path / "token")
    elif auth == "mtls":
        certs = await asyncio.to_thread(_certs, tmp_path, {"engines": ["prefill", "decode"]})
        settings = {"tls_cert": certs["engines"][0], "tls_key": certs["engines"][1], "tls_ca": str(tmp_path / "ca.pem")}
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, **settings)
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=1)
    res = await dw[0].pull("r1", ps, {"kv": [3, 4]})  # handshakes; the frames connection opens after it
    assert dw[0].verify({"kv": [3, 4]}, salt=1) == (res.bytes, 0)
    await _framed(ds[0], ps[0])
    await _freed(pw[0])
    before = _frames_calls(ps[0])
    await pw[0].prefill("r2", {"kv": [5, 6, 7]}, salt=2)
    res = await dw[0].pull("r2", ps, {"kv": [8, 9, 10]})
    assert dw[0].verify({"kv": [8, 9, 10]}, salt=2) == (res.bytes, 0)
    assert res.fetch_seconds > 0  # it looked its publish up (no grant, no read-ahead)
    await _freed(pw[0])
    assert _frames_calls(ps[0]) - before == Counter({"GetPublished": 1, "Notify": 1})

    # A queued request's hold goes as a frame too, and its pull reads on the grant.
    await pw[0].prefill("r3", {"kv": [11]}, salt=3)
    before = _frames_calls(ps[0])
    assert await dw[0].client.expect("r3", [ps[0].peer_address])
    for _ in range(300):
        if _frames_calls(ps[0])["Hold"] > before["Hold"]:
            break
        await asyncio.sleep(0.01)
    res = await dw[0].pull("r3", ps, {"kv": [12]})
    assert dw[0].verify({"kv": [12]}, salt=3) == (res.bytes, 0)
    await _freed(pw[0])
    grew = _frames_calls(ps[0]) - before
    assert grew["Hold"] >= 1
    assert grew["Notify"] == 1


async def test_a_frames_hello_needs_the_token(harness: Harness, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(SECRET)
    ps, _pw, _ds, _dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, token_file=str(tmp_path / "token"))
    assert ps[0].peer_frames is not None
    host, port = "127.0.0.1", ps[0].peer_frames.port
    for token, why in ((None, "the hello carries no token"), ("wrong", "the token in the hello is not valid")):
        with pytest.raises(FastHelloRefusedError) as err:
            await FastChannel.open_tcp(host, port, tls=None, hello=PEER_HELLO, token=token, timeout=5,
                                       max_message_bytes=1 << 20)  # fmt: skip
        code, message, reason, field = error_from_status_message(err.value.status)
        assert (code, reason.value, field) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", "authorization")
        assert message == f"peer frames listener: {why}"
    # The local fast socket's hello is not a peer's.
    with pytest.raises(FastHelloRefusedError) as err:
        await FastChannel.open_tcp(host, port, tls=None, hello=b"kvxfer-frames/1\n", token=SECRET, timeout=5,
                                   max_message_bytes=1 << 20)  # fmt: skip
    assert error_from_status_message(err.value.status)[0] == grpc.StatusCode.INVALID_ARGUMENT


async def test_over_frames_a_certificate_still_names_the_only_engine_its_holder_may_be(
    harness: Harness, tmp_path: Path
) -> None:
    certs = await asyncio.to_thread(_certs, tmp_path, {"engines": ["prefill", "decode"], "rogue": ["rogue"]})
    ca = str(tmp_path / "ca.pem")
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, tls_cert=certs["engines"][0],
                                              tls_key=certs["engines"][1], tls_ca=ca)  # fmt: skip
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=4)
    assert ps[0].peer_frames is not None
    assert ds[0].core is not None
    port = ps[0].peer_frames.port
    ask = peer_pb2.GetPublishedRequest(request_id="r1", engine_id="decode", instance_id=ds[0].core.instance_id,
                                       rank=rank_to_proto(ds[0].core.identity().rank))  # fmt: skip

    rogue = ssl.create_default_context(cafile=ca)
    rogue.load_cert_chain(*certs["rogue"])
    ch = await FastChannel.open_tcp("127.0.0.1", port, tls=rogue, hello=PEER_HELLO, token=None, timeout=5,
                                    max_message_bytes=1 << 20)  # fmt: skip
    try:
        code, body = await ch.call(1, ask.SerializeToString(), 5)  # GetPublished, claiming to be 'decode'
    finally:
        ch.close()
    got, message, reason, field = error_from_status_message(body)
    assert (code, got, reason.value, field) == (7, grpc.StatusCode.PERMISSION_DENIED, "IDENTITY", "engine_id")
    assert "engine id 'decode' is not named by the caller's client certificate" in message

    # Without a client certificate the TLS handshake fails: no hello, no call.
    # (TLS 1.3: the server's refusal comes as the connection closing under the hello; 1.2: an SSLError.)
    with pytest.raises((FastCallError, ssl.SSLError)):
        await FastChannel.open_tcp("127.0.0.1", port, tls=ssl.create_default_context(cafile=ca), hello=PEER_HELLO,
                                   token=None, timeout=5, max_message_bytes=1 << 20)  # fmt: skip
    # The real decode engine still reads, exactly (its first pull handshakes over gRPC), and then
    # has a frames connection of its own.
    res = await dw[0].pull("r1", ps, {"kv": [3, 4]})
    assert dw[0].verify({"kv": [3, 4]}, 4) == (res.bytes, 0)
    await _framed(ds[0], ps[0])


def test_a_frames_address_is_used_only_on_the_host_dialed() -> None:
    assert same_host("127.0.0.1:50051", "127.0.0.1:40000") == ("127.0.0.1", 40000)
    assert same_host("[::1]:50051", "[::1]:40000") == ("::1", 40000)
    assert same_host("127.0.0.1:50051", "10.0.0.9:40000") is None  # a peer cannot send the reader elsewhere
    assert same_host("prefill-0.kvxfer:50051", "10.0.0.9:40000") is None
    assert same_host("127.0.0.1:50051", "127.0.0.1:0") is None
    assert same_host("127.0.0.1:50051", "not an address") is None


async def test_without_peer_frames_or_after_the_connection_is_lost_calls_go_over_grpc(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    off = await harness.sidecar(role="prefill", engine_id="prefill-b", peer_frames=False)
    assert off.peer_frames is None
    assert off.core is not None
    assert ds[0].core is not None
    ow = await harness.worker(off, {"kv": LAY})
    await ow.prefill("b1", {"kv": [1]}, salt=6)
    res = await dw[0].pull("b1", [off], {"kv": [2]})
    assert dw[0].verify({"kv": [2]}, 6) == (res.bytes, 0)
    assert off.core.identity().frames_address == ""
    await asyncio.sleep(0.2)
    assert not ds[0].core.peers.framed(off.peer_address)  # nothing offered, nothing opened

    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=7)
    await dw[0].pull("r1", ps, {"kv": [3, 4]})
    await _framed(ds[0], ps[0])
    await _freed(pw[0])
    # The reader's connection goes away (as when the network drops it) while the publisher still
    # serves frames.
    ds[0].core.peers._frames[ps[0].peer_address].close()
    await asyncio.sleep(0.05)
    before = _frames_calls(ps[0])
    await pw[0].prefill("r2", {"kv": [5]}, salt=8)
    res = await dw[0].pull("r2", ps, {"kv": [6]})
    assert dw[0].verify({"kv": [6]}, 8) == (res.bytes, 0)
    await _freed(pw[0])
    # Its lookup found the connection closed and went over gRPC; the reader dialled again at once,
    # without a new handshake (its notice, 5 ms later, may have taken the new connection).
    assert (_frames_calls(ps[0]) - before)["GetPublished"] == 0
    await _framed(ds[0], ps[0])
    before = _frames_calls(ps[0])
    await pw[0].prefill("r3", {"kv": [9]}, salt=9)
    res = await dw[0].pull("r3", ps, {"kv": [10]})
    assert dw[0].verify({"kv": [10]}, 9) == (res.bytes, 0)
    await _freed(pw[0])
    assert _frames_calls(ps[0]) - before == Counter({"GetPublished": 1, "Notify": 1})

    # A publisher that stops serving frames refuses connections that arrive late and calls alike.
    assert ps[0].peer_frames is not None
    await ps[0].peer_frames.api.close()
    await pw[0].prefill("r4", {"kv": [11]}, salt=10)
    res = await dw[0].pull("r4", ps, {"kv": [12]})
    assert dw[0].verify({"kv": [12]}, 10) == (res.bytes, 0)


async def test_a_frames_connection_is_kept_only_to_the_instance_handshaken(harness: Harness) -> None:
    a = await harness.sidecar(role="prefill", engine_id="prefill-a")
    b = await harness.sidecar(role="prefill", engine_id="prefill-b")
    assert a.core is not None
    assert b.core is not None
    assert b.peer_frames is not None
    dialer = FramesDialer(None, None, 1 << 20)
    # b's frames port is on the host dialed for a, but b is not the instance a's handshake named
    with pytest.raises(OSError, match=f"answered as instance '{b.core.instance_id}', not the handshake's"):
        await dialer.open(a.peer_address, b.peer_frames.address, a.core.instance_id)
    framed = await dialer.open(b.peer_address, b.peer_frames.address, b.core.instance_id)
    framed.close()


async def test_a_connection_that_does_not_say_hello_is_closed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fast_api, "HELLO_WITHIN_S", 0.3)
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    assert p.peer_frames is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", p.peer_frames.port)
    try:
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sidecar, nothing said
        assert asyncio.get_running_loop().time() - t0 < 2
    finally:
        writer.close()


def _unavailable() -> grpc.aio.AioRpcError:
    """FAKE fault: a hot call lost with its connection (what a dropped TCP connection gives a call)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the frames connection was lost")  # fmt: skip


async def test_a_late_failure_on_a_replaced_connection_does_not_reset_the_replacement(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await pw[0].prefill("r1", {"kv": [1]}, salt=3)
    await dw[0].pull("r1", ps, {"kv": [2]})
    await _framed(ds[0], ps[0])
    assert ds[0].core is not None
    peers, address = ds[0].core.peers, ps[0].peer_address
    old_framed, old_session = peers._frames[address], peers._sessions[address]
    release = asyncio.Event()

    async def lost_later(stub: object) -> None:
        assert stub is old_framed  # it went as a frame on the connection of the time
        await release.wait()
        raise _unavailable()

    async def lost_now(stub: object) -> None:
        assert stub is old_framed
        raise _unavailable()

    slow = asyncio.ensure_future(peers.call(address, "GetPublished", lost_later))
    await asyncio.sleep(0)
    with pytest.raises(KvxferError):
        await peers.call(address, "GetPublished", lost_now)
    # The first failure reset the peer: its session and connection go, the next use handshakes again.
    assert address not in peers._sessions
    assert address not in peers._frames
    await asyncio.sleep(0.05)
    assert old_framed.closed
    await pw[0].prefill("r2", {"kv": [3]}, salt=4)
    await dw[0].pull("r2", ps, {"kv": [4]})
    await _framed(ds[0], ps[0])
    new_session, new_framed = peers._sessions[address], peers._frames[address]
    assert new_session is not old_session
    assert new_framed is not old_framed
    # The call still in flight on the old connection fails now: it must not reset the new one.
    release.set()
    with pytest.raises(KvxferError):
        await slow
    assert peers._sessions.get(address) is new_session
    assert peers._frames.get(address) is new_framed
    assert not new_framed.closed
    await pw[0].prefill("r3", {"kv": [5]}, salt=5)
    before = _frames_calls(ps[0])
    res = await dw[0].pull("r3", ps, {"kv": [6]})
    assert dw[0].verify({"kv": [6]}, 5) == (res.bytes, 0)
    assert (_frames_calls(ps[0]) - before)["GetPublished"] == 1  # still as a frame, on the replacement
