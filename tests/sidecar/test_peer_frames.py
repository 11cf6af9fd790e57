"""The peer API's hot calls as frames between sidecars (kvxfer.server.peer_frames): used, exact, and no weaker.

Lookups, notices and holds go as frames once a reader's frames connection to its publisher is open;
the connection carries the peer API's credentials (token in the hello, TLS with the same
certificates, the client certificate's engine names for every call on it), and a reader uses only
a frames address on the host it dialed. A connection that goes away leaves the calls to gRPC.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import grpc
import pytest

from kvxfer.fastsock import FastCallError, FastChannel, FastHelloRefusedError
from kvxfer.server.app import Sidecar
from kvxfer.server.peer_frames import same_host
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import rank_to_proto
from kvxfer.wire.frames import PEER_HELLO
from kvxfer.wire.status import error_from_status_message
from tests.sidecar.helpers import Harness, attention
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


def _frames_calls(s: Sidecar) -> int:
    assert s.peer_frames is not None
    return s.peer_frames.api.calls_started


async def _settled(s: Sidecar, want: int) -> None:
    for _ in range(200):  # a DONE notice lingers a few ms before it leaves
        if _frames_calls(s) >= want:
            return
        await asyncio.sleep(0.01)


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
    before = _frames_calls(ps[0])
    await pw[0].prefill("r2", {"kv": [5, 6, 7]}, salt=2)
    res = await dw[0].pull("r2", ps, {"kv": [8, 9, 10]})
    assert dw[0].verify({"kv": [8, 9, 10]}, salt=2) == (res.bytes, 0)
    assert res.fetch_seconds > 0  # it looked its publish up (no grant, no read-ahead)
    await _settled(ps[0], before + 2)
    assert _frames_calls(ps[0]) == before + 2  # its GetPublished and its DONE notice, as frames
    for _ in range(200):  # the notice frees the publish as it is handled (just after it arrived)
        if (await pw[0].client.status())["leases"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await pw[0].client.status())["leases"] == 0


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
    # The real decode engine still reads, exactly, and over frames.
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
    assert ps[0].peer_frames is not None
    await ps[0].peer_frames.api.close()  # the publisher stops serving frames (its connections close)
    for _ in range(100):
        if not ds[0].core.peers.framed(ps[0].peer_address):
            break
        await asyncio.sleep(0.01)
    before = _frames_calls(ps[0])
    await pw[0].prefill("r2", {"kv": [5]}, salt=8)
    res = await dw[0].pull("r2", ps, {"kv": [6]})
    assert dw[0].verify({"kv": [6]}, 8) == (res.bytes, 0)
    assert _frames_calls(ps[0]) == before  # over gRPC
