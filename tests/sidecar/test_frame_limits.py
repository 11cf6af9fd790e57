"""Messages over ``--max-message-bytes`` on the frame sockets fail their own call only, as over gRPC.

A sidecar never sends an answer over its own limit (it answers RESOURCE_EXHAUSTED, field
``answer``, as a gRPC server fails such a call); a client that gets an answer over its limit for a
call it waits for drops the answer's bytes and fails that call alone. Either way the connection,
and every other call on it, goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvxfer.client import PullItem
from kvxfer.client.aio import KvxferRpcError
from kvxfer.errors import Reason
from kvxfer.fastsock import BlockingFastConnection, FastChannel
from kvxfer.wire.frames import ANSWER, HELLO_CALL, REQUEST
from kvxfer.wire.status import error_from_status_message
from tests.sidecar.helpers import Harness, attention
from tests.sidecar.test_peer_frames import _framed, _frames_calls

#: Many one-token blocks of 32 bytes: block lists that weigh tens of KB in a message, in a small region.
MANY = attention(layers=1, blocks=20_000, block_size=1, heads=1, head_size=8)
LIMIT = 65_536
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


async def test_a_lookup_answer_over_the_publishers_limit_fails_only_its_pulls(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill", max_message_bytes=LIMIT)
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw, dw = await harness.worker(p, {"kv": MANY}), await harness.worker(d, {"kv": MANY})
    await pw.prefill("warm", {"kv": [1]}, 1)
    await dw.pull("warm", [p], {"kv": [2]})
    await _framed(d, p)
    ids = np.arange(10_000)
    for i in range(4):  # each publish ~20 KB of ids, under the limit; the four lookups' one answer ~80 KB
        await pw.prefill(f"big{i}", {"kv": ids}, 2 + i)
    items = [PullItem(f"big{i}", [p.peer_address], {"kv": ids + 10_000}, deadline=10) for i in range(4)]
    got = await dw.client.pull_batch(items)
    for g in got:
        assert isinstance(g, KvxferRpcError)
        assert g.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "answer: 79880 bytes are over this sidecar's limit of 65536 bytes (--max-message-bytes)" in g.details
    # The same frames connection carries the next lookup, which moves its bytes.
    assert _frames_calls(p)["GetPublished"] == 0
    await pw.prefill("after", {"kv": [3, 4]}, 9)
    await dw.pull("after", [p], {"kv": [5, 6]})
    assert _frames_calls(p)["GetPublished"] == 1
    assert d.core is not None
    assert d.core.peers.framed(p.peer_address)


class LargerLimitSidecar:
    """FAKE (named so): a frame server whose limit is above its client's, which a real sidecar
    cannot be made to show on demand (its answers to the local calls are small): method 1 is
    answered with ``LIMIT + 100`` bytes, method 2 with ``ok``, after an answered hello."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                conn, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            while head := reader.read(REQUEST.size):
                n, call, method, _ = REQUEST.unpack(head)
                reader.read(n)
                body = b"\0" * (LIMIT + 100) if call != HELLO_CALL and method == 1 else b"ok" if call else b""
                conn.sendall(ANSWER.pack(len(body), call, 0) + body)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def larger(tmp_path: Path) -> Iterator[LargerLimitSidecar]:
    server = LargerLimitSidecar(tmp_path / "fast.sock")
    yield server
    server.close()


def _exhausted(answer: tuple[int, bytes]) -> None:
    code, status = answer
    assert code == EXHAUSTED
    _, message, reason, field = error_from_status_message(status)
    assert (reason, field) == (Reason.INVALID_FIELD, "answer")
    assert message == f"answer: {LIMIT + 100} bytes are over this client's limit of {LIMIT} bytes (max_message_bytes)"


async def test_an_answer_over_the_clients_limit_fails_only_its_call_async(larger: LargerLimitSidecar) -> None:
    ch = await FastChannel.open(larger.path, token=None, timeout=5, max_message_bytes=LIMIT)
    try:
        big, small = await asyncio.gather(ch.call(1, b"", 5), ch.call(2, b"", 5))
        _exhausted(big)
        assert small == (0, b"ok")
        assert await ch.call(2, b"", 5) == (0, b"ok")
        assert not ch.closed
    finally:
        ch.close()


def test_an_answer_over_the_clients_limit_fails_only_its_call_blocking(larger: LargerLimitSidecar) -> None:
    conn = BlockingFastConnection.open(larger.path, token=None, timeout=5, max_message_bytes=LIMIT)
    try:
        _exhausted(conn.call(1, b"", 5))
        assert conn.call(2, b"", 5) == (0, b"ok")
        conn.post(1, b"", 5)  # its answer, over the limit, is dropped at the next call
        assert conn.call(2, b"", 5) == (0, b"ok")
        assert not conn.closed
    finally:
        conn.close()
