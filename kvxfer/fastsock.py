"""The local fast socket, worker side: one connection carrying a worker's hot calls as frames.

:class:`kvxfer.client.AsyncClient` sends ``Pull``, ``PullBatch`` and ``Publish`` here when its
sidecar serves the fast socket (format and rationale: :mod:`kvxfer.wire.frames`), and every other
call, or every call when the socket cannot be reached, over gRPC. This module only moves frames:
turning an answer into a response or a :class:`kvxfer.client.KvxferRpcError` is the client's.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from kvxfer.errors import ResourceExhaustedError
from kvxfer.logs import get_logger
from kvxfer.wire.frames import ANSWER, CANCEL, HELLO, HELLO_CALL, REQUEST
from kvxfer.wire.status import status_message

__all__ = ["BlockingFastConnection", "FastCallError", "FastChannel", "FastHelloRefusedError"]

log = get_logger("kvxfer.fastsock")
#: Quiet calls (:meth:`FastChannel.tell`) a connection remembers, to report the failure of one.
QUIET_KEPT = 4096


def _over_limit(n: int, limit: int) -> tuple[int, bytes]:
    """The answer a call gets in place of one over this side's limit (as gRPC fails such a call)."""
    exc = ResourceExhaustedError(
        f"answer: {n} bytes are over this client's limit of {limit} bytes (max_message_bytes)", field="answer"
    )
    status = status_message(exc)
    return status.code, status.SerializeToString()


def _expire(fut: asyncio.Future[tuple[int, bytes]]) -> None:
    """A call's deadline passed before its answer came."""
    if not fut.done():
        fut.set_exception(TimeoutError())


def _drop(buf: bytearray, skip: int) -> int:
    """Drop up to ``skip`` bytes (the rest of an answer over the limit) from ``buf``; how many remain to drop."""
    dropped = min(skip, len(buf))
    del buf[:dropped]
    return skip - dropped


class FastCallError(ConnectionError):
    """The connection failed a call; ``sent`` says whether the request had gone out.

    A call that was not sent may go over gRPC instead; one that was sent may have started in the
    sidecar (a pull), so it fails as an unreachable sidecar would fail it over gRPC.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class FastHelloRefusedError(Exception):
    """The sidecar refused the connection's hello: ``code`` and ``status`` (a serialized google.rpc.Status)."""

    def __init__(self, code: int, status: bytes) -> None:
        super().__init__(f"the sidecar refused the fast socket's hello (status {code})")
        self.code = code
        self.status = status


class FastChannel(asyncio.Protocol):
    """One connection to a sidecar's fast socket; calls in flight are matched to answers by id.

    Bound to the event loop that opened it, like a grpc.aio channel.
    """

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._skip = 0  # bytes of an answer over the limit still to drop
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        #: Quiet calls sent (:meth:`tell`), the newest QUIET_KEPT: method number and payload, as bytes
        #: (which the garbage collector does not track: a busy caller keeps thousands).
        self._quiet: OrderedDict[int, bytes] = OrderedDict()
        #: Told ``(method, payload, code, status)`` when a quiet call's failure comes.
        self.on_quiet_failure: Callable[[int, bytes, int, bytes], None] | None = None
        self._last = HELLO_CALL
        self._transport: asyncio.Transport | None = None
        self.closed = False
        #: What the server put in its answer to the hello (a peer sidecar: its instance id).
        self.hello_answer = b""

    @classmethod
    async def open(
        cls, path: str | os.PathLike[str] | Path, *, token: str | None, timeout: float, max_message_bytes: int
    ) -> FastChannel:
        """Connect and say hello; OSError when nobody listens there, FastHelloRefusedError when refused."""
        loop = asyncio.get_running_loop()
        return await cls._open(
            lambda: loop.create_unix_connection(lambda: cls(max_message_bytes), os.fspath(path)), HELLO, token, timeout
        )

    @classmethod
    async def open_tcp(
        cls, host: str, port: int, *, tls: ssl.SSLContext | None, hello: bytes, token: str | None, timeout: float,
        max_message_bytes: int, server_name: str | None = None,
    ) -> FastChannel:  # fmt: skip
        """A peer sidecar's frames (:data:`kvxfer.wire.frames.PEER_METHODS`); under TLS its certificate
        is checked against ``server_name``, else ``host``, as gRPC checks it against the address dialed."""
        loop = asyncio.get_running_loop()
        return await cls._open(
            lambda: loop.create_connection(lambda: cls(max_message_bytes), host, port, ssl=tls,
                                           server_hostname=(server_name or host) if tls is not None else None),
            hello, token, timeout,
        )  # fmt: skip

    @classmethod
    async def _open(
        cls, connect: Callable[[], Awaitable[tuple[Any, FastChannel]]], hello: bytes, token: str | None, timeout: float
    ) -> FastChannel:
        async with asyncio.timeout(timeout):
            _, ch = await connect()
            try:
                code, status = await ch._exchange(HELLO_CALL, 0, hello + (token or "").encode(), timeout)
            except BaseException:
                ch.close()
                raise
        if code != 0:
            ch.close()
            raise FastHelloRefusedError(code, status)
        ch.hello_answer = status
        return ch

    async def call(self, method: int, payload: bytes, timeout: float) -> tuple[int, bytes]:
        """One call: (status code, response message or serialized google.rpc.Status).

        TimeoutError past ``timeout`` seconds; the sidecar is told to abandon the call then, and
        when the caller cancels it (as gRPC does for a call's deadline or cancellation).
        """
        if self.closed or self._transport is None or self._transport.is_closing():
            raise FastCallError("the fast socket's connection is closed", sent=False)
        if len(payload) > self.max_message_bytes:
            # Over gRPC's limit too: let the gRPC path refuse it, with gRPC's own status.
            raise FastCallError("the request is over max_message_bytes", sent=False)
        self._last = self._last % 0xFFFFFFFE + 1  # ids 1..2^32-2, never HELLO_CALL
        return await self._exchange(self._last, method, payload, timeout)

    def tell(self, method: int, payload: bytes, timeout: float) -> None:
        """Send a call of a quiet method (answered only when it fails) without waiting for it.

        :attr:`on_quiet_failure` is told ``(method, payload, code, status)`` if its failure comes
        (``status``: a serialized google.rpc.Status). A quiet call that succeeds is never heard of
        again, so only the newest :data:`QUIET_KEPT` are remembered: the failure of an older one, or
        of one whose connection closed, goes unreported here (the sidecar logs it).
        """
        if self.closed or self._transport is None or self._transport.is_closing():
            raise FastCallError("the fast socket's connection is closed", sent=False)
        if len(payload) > self.max_message_bytes:
            raise FastCallError("the request is over max_message_bytes", sent=False)
        self._last = self._last % 0xFFFFFFFE + 1
        self._quiet[self._last] = bytes((method,)) + payload
        if len(self._quiet) > QUIET_KEPT:
            self._quiet.popitem(last=False)
        self._transport.write(REQUEST.pack(len(payload), self._last, method, timeout) + payload)

    async def _exchange(self, call: int, method: int, payload: bytes, timeout: float) -> tuple[int, bytes]:
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self._waiting[call] = fut
        self._transport.write(REQUEST.pack(len(payload), call, method, timeout) + payload)
        # A timer that fails the future, not asyncio.timeout(): every hot call of a worker and of a
        # peer channel runs here, and the context manager costs several times as much per call.
        timer = loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        except (TimeoutError, asyncio.CancelledError):
            self._waiting.pop(call, None)
            if not self.closed and self._transport is not None and not self._transport.is_closing():
                self._transport.write(REQUEST.pack(0, call, CANCEL, 0.0))
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        """Close the connection; calls in flight fail with FastCallError (sent)."""
        if self._transport is not None:
            self._transport.close()

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def _report(self, sent: bytes, code: int, status: bytes) -> None:
        """Tell the caller of a quiet call's failure; a hook that raises must not break the reading."""
        hook = self.on_quiet_failure
        if hook is None:
            return
        try:
            hook(sent[0], sent[1:], code, status)
        except Exception:
            log.exception("a quiet call's failure hook raised")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(FastCallError(f"the sidecar closed the fast socket's connection ({exc})", sent=True))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        buf = self._buf
        while True:
            self._skip = _drop(buf, self._skip)
            if self._skip or len(buf) < ANSWER.size:
                return
            n, call, code = ANSWER.unpack_from(buf, 0)
            if n > self.max_message_bytes:
                fut = self._waiting.pop(call, None)
                quiet = self._quiet.pop(call, None) if fut is None else None
                if fut is None and quiet is None:
                    # no call of ours: not a sidecar speaking this format, give up the connection
                    self.close()
                    return
                # A sidecar with a larger limit: only this call fails; the answer's bytes are dropped.
                if quiet is not None:
                    self._report(quiet, *_over_limit(n, self.max_message_bytes))
                elif fut is not None and not fut.done():
                    fut.set_result(_over_limit(n, self.max_message_bytes))
                del buf[: ANSWER.size]
                self._skip = n
                continue
            if len(buf) < ANSWER.size + n:
                return
            fut = self._waiting.pop(call, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result((code, bytes(buf[ANSWER.size : ANSWER.size + n])))
            else:
                quiet = self._quiet.pop(call, None)
                if quiet is not None:
                    self._report(quiet, code, bytes(buf[ANSWER.size : ANSWER.size + n]))
            del buf[: ANSWER.size + n]


class BlockingFastConnection:
    """One connection to a sidecar's fast socket used by one thread, one call at a time, blocking.

    What a synchronous caller (:class:`kvxfer.client.Client` from its own thread) uses instead of
    handing each call to an event-loop thread and back: measured on the lent H200's host
    (``bench/local_hop.py``), a Pull round trip of 31 us this way against 88 us through the loop
    thread. Not thread-safe: give each thread its own.
    """

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self._sock = sock
        self.max_message_bytes = max_message_bytes
        self._buf = bytearray()
        self._skip = 0  # bytes of an answer over the limit still to drop
        self._last = HELLO_CALL
        self._posted: set[int] = set()  # calls sent by post() whose answers were not read yet
        self.closed = False
        # A connection whose thread ended is collected with it: its socket closes then.
        self._finalizer = weakref.finalize(self, sock.close)

    @classmethod
    def open(
        cls, path: str | os.PathLike[str] | Path, *, token: str | None, timeout: float, max_message_bytes: int
    ) -> BlockingFastConnection:
        """Connect and say hello; OSError when nobody listens there, FastHelloRefusedError when refused."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = cls(sock, max_message_bytes)
        try:
            sock.settimeout(timeout)
            sock.connect(os.fspath(path))
            code, status = conn._exchange(HELLO_CALL, 0, HELLO + (token or "").encode(), timeout)
        except FastCallError as exc:
            conn.close()
            raise ConnectionError(str(exc)) from None
        except BaseException:
            conn.close()
            raise
        if code != 0:
            conn.close()
            raise FastHelloRefusedError(code, status)
        return conn

    def call(
        self, method: int, payload: bytes, timeout: float, *, while_waiting: Callable[[], None] | None = None,
        spin_s: float = 0.0,
    ) -> tuple[int, bytes]:  # fmt: skip
        """One call: (status code, response message or serialized google.rpc.Status).

        TimeoutError past ``timeout`` seconds (the sidecar is told to abandon the call);
        FastCallError when the connection failed (``sent`` as for :class:`FastChannel`).
        ``while_waiting`` runs once the request is sent; then the thread polls the socket without
        sleeping for up to ``spin_s`` seconds before it blocks (a worker about to launch a gather
        keeps its code warm so; see :meth:`kvxfer.client.gather.WorkerGather.warm_up`).
        """
        if self.closed:
            raise FastCallError("the fast socket's connection is closed", sent=False)
        if len(payload) > self.max_message_bytes:
            raise FastCallError("the request is over max_message_bytes", sent=False)
        self._last = self._last % 0xFFFFFFFE + 1
        return self._exchange(self._last, method, payload, timeout, while_waiting, spin_s)

    def post(self, method: int, payload: bytes, timeout: float) -> None:
        """Send a call and do not wait for its answer (the next call skips it; a failure is logged then).

        For a report whose outcome the caller does not need now (``GatherDone`` of a gather that
        settled the pull already): one write, and no other thread woken to wait for the answer.
        """
        if self.closed:
            raise FastCallError("the fast socket's connection is closed", sent=False)
        if len(payload) > self.max_message_bytes:
            raise FastCallError("the request is over max_message_bytes", sent=False)
        self._last = self._last % 0xFFFFFFFE + 1
        self._posted.add(self._last)
        try:
            self._sock.settimeout(max(timeout, 1e-6))
            self._sock.sendall(REQUEST.pack(len(payload), self._last, method, timeout) + payload)
        except OSError as exc:
            self.close()
            raise FastCallError(f"could not send on the fast socket: {exc}", sent=False) from None

    def _exchange(
        self, call: int, method: int, payload: bytes, timeout: float,
        while_waiting: Callable[[], None] | None = None, spin_s: float = 0.0,
    ) -> tuple[int, bytes]:  # fmt: skip
        until = time.monotonic() + timeout
        try:
            self._sock.settimeout(max(timeout, 1e-6))
            self._sock.sendall(REQUEST.pack(len(payload), call, method, timeout) + payload)
        except OSError as exc:
            # A frame cut short is no call the sidecar runs: the connection is given up with it.
            self.close()
            raise FastCallError(f"could not send on the fast socket: {exc}", sent=False) from None
        if while_waiting is not None:
            while_waiting()
        spin_until = min(time.monotonic() + spin_s, until) if spin_s > 0 else 0.0
        while True:
            try:
                got, code, body = self._next_answer(until, call, spin_until)
            except TimeoutError:
                self._cancel(call)
                raise
            except OSError as exc:
                self.close()
                raise FastCallError(f"the fast socket's connection failed: {exc}", sent=True) from None
            if got == call:
                return code, body
            # Else the late answer of a call this thread gave up on, or of one it posted: skipped.
            if got in self._posted:
                self._posted.discard(got)
                if code != 0:
                    log.warning("a call posted on the fast socket failed", extra={"code": code})

    def _next_answer(self, until: float, call_sent: int, spin_until: float = 0.0) -> tuple[int, int, bytes]:
        buf = self._buf
        while True:
            self._skip = _drop(buf, self._skip)
            if not self._skip and len(buf) >= ANSWER.size:
                n, call, code = ANSWER.unpack_from(buf, 0)
                if n > self.max_message_bytes:
                    if call != call_sent and call not in self._posted:
                        raise ConnectionError(f"an answer of {n} bytes: not a sidecar speaking this format")
                    # A sidecar with a larger limit: only this call fails; the answer's bytes are dropped.
                    del buf[: ANSWER.size]
                    self._skip = n
                    return (call, *_over_limit(n, self.max_message_bytes))
                if len(buf) >= ANSWER.size + n:
                    body = bytes(buf[ANSWER.size : ANSWER.size + n])
                    del buf[: ANSWER.size + n]
                    return call, code, body
            now = time.monotonic()
            left = until - now
            if left <= 0:
                raise TimeoutError
            if now < spin_until:  # polled without sleeping (a timeout of 0: no poll() before the recv)
                if self._sock.gettimeout() != 0.0:
                    self._sock.settimeout(0.0)
                try:
                    chunk = self._sock.recv(1 << 16)
                except BlockingIOError:
                    continue
            else:
                self._sock.settimeout(left)
                chunk = self._sock.recv(1 << 16)  # TimeoutError when ``left`` passes
            if not chunk:
                raise ConnectionError("the sidecar closed the fast socket's connection")
            buf += chunk

    def _cancel(self, call: int) -> None:
        try:
            self._sock.settimeout(1.0)
            self._sock.sendall(REQUEST.pack(0, call, CANCEL, 0.0))
        except OSError:
            self.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self.closed = True
        self._finalizer()
