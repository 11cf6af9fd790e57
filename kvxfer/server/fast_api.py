"""The local fast socket, sidecar side: the worker's hot calls as frames (format: :mod:`kvxfer.wire.frames`).

A worker's hot calls (:data:`kvxfer.wire.frames.METHODS`: ``Pull``, ``PullBatch``, ``Publish``,
``Expect``, ...) arrive here as frames and run through the very
method the gRPC servicer calls (:class:`kvxfer.server.servicers.LocalServicer`) inside
:func:`kvxfer.server.rpc.run_unary`, under the same per-method limits: the same validation, request
id in the logs, deadline and errors (code, message, reason, field) as over gRPC. Only the framing
differs, which saves the ~0.5 ms per call that gRPC's HTTP/2 costs on a busy two-core host.

Access is that of the local API's socket: the socket has mode 0660 before anyone can connect
(bound, chmod, then listen), and with a token every connection's hello must carry it (compared in
constant time).

The same class serves the peer API's hot calls (:data:`kvxfer.wire.frames.PEER_METHODS`) to other
sidecars on TCP (:meth:`FastApi.start_tcp`), under the peer API's TLS: with client certificates a
connection's certificate is its caller's credentials for every call on it
(:class:`kvxfer.server.peer_auth.PeerCredentials`, as gRPC's auth context gives them), and the
hello carries the cluster's token where gRPC carries it in each call's metadata.

A frame this side cannot use is answered with an error naming what is wrong, and only its own call
fails; a frame too long for ``--max-message-bytes`` or a connection that does not say hello first
is answered and the connection closed. A call runs until it answers, its client cancels it, or the
connection closes (then it is cancelled, as gRPC cancels a call whose client went away).

Flow control, per connection, as HTTP/2 gives each gRPC connection: while more than
:data:`WRITE_HIGH` bytes of answers wait for a client that does not read them, or while
:data:`MAX_CALLS_IN_FLIGHT` of its calls run, nothing more is read from that connection (its
further frames wait in the socket, and then its client's writes wait); reading resumes once the
answers are down to :data:`WRITE_LOW` bytes and a call ended. A connection also starts at most
:data:`MAX_CALLS_PER_TURN` calls before the event loop has run them (uvloop hands over up to 32
reads of 256 KiB at once): the next frames wait for the loop's next turn, when the answers of the
calls that answer at once are in the write buffer and counted. Other connections never notice.
The hot path pays a counter and a test per frame for it, and a pause and resume of reading per
:data:`MAX_CALLS_PER_TURN` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import math
import os
import socket
import ssl
import stat
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, cast

from kvxfer.errors import (
    InvalidArgumentError,
    KvxferError,
    Reason,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from kvxfer.logs import get_logger, log_context
from kvxfer.server.peer_auth import URIS_PROPERTY
from kvxfer.server.rpc import Unary, parse_request, run_unary, snake_case
from kvxfer.wire import local_pb2
from kvxfer.wire.frames import ANSWER, CANCEL, HELLO, HELLO_CALL, METHODS, REQUEST, FastMethod
from kvxfer.wire.status import status_message

__all__ = ["AuthContext", "FastApi", "tls_auth_context"]

log = get_logger("kvxfer.server.fast")
_SERVICE = local_pb2.DESCRIPTOR.services_by_name["Local"].full_name
_MAX_HELLO = 16 * 1024
#: Seconds a connection has to say hello before it is closed (nothing else is read from it before).
HELLO_WITHIN_S = 10.0
#: Bytes of answers a connection's client may leave unread before nothing more is read from it ...
WRITE_HIGH = 1 << 20
#: ... until they are down to this many.
WRITE_LOW = 256 << 10
#: Calls one connection may have running at once; its further frames wait until one ends (far above
#: what a worker or a peer sends: a worker's pulls in flight, one at most per request it loads).
MAX_CALLS_IN_FLIGHT = 4096
#: Calls one connection may start before the loop runs them (see the module docs).
MAX_CALLS_PER_TURN = 32


class _UnimplementedError(KvxferError):
    status = "UNIMPLEMENTED"
    default_reason = Reason.UNSUPPORTED


#: A connection's credentials as gRPC's ``auth_context()`` names them (property -> values).
AuthContext = Mapping[str, list[bytes]]
_NO_AUTH: AuthContext = {}


class _Context:
    """What the servicer's methods read of a call's context: the time left, the caller's credentials."""

    __slots__ = ("_auth", "_expires")

    def __init__(self, timeout: float, auth: AuthContext) -> None:
        self._expires = time.monotonic() + timeout if timeout > 0 else None
        self._auth = auth

    def time_remaining(self) -> float | None:
        return None if self._expires is None else max(self._expires - time.monotonic(), 0.0)

    def auth_context(self) -> AuthContext:
        return self._auth


def tls_auth_context(peercert: Any) -> AuthContext:
    """The client certificate's URI names under gRPC's auth-context key (what peer_auth reads)."""
    if not peercert:
        return _NO_AUTH
    uris = [v.encode() for kind, v in peercert.get("subjectAltName", ()) if kind == "URI"]
    return {URIS_PROPERTY: uris} if uris else _NO_AUTH


class _Method:
    __slots__ = ("fn", "full", "limit", "name", "quiet", "request")

    def __init__(self, fn: Unary, full: str, limit: float | None, request: Any, quiet: bool) -> None:
        self.fn, self.full, self.limit, self.request, self.quiet = fn, full, limit, request, quiet
        self.name = full.rsplit("/", 1)[1]


class FastApi:
    """Serves ``methods`` (by default :data:`kvxfer.wire.frames.METHODS`) of ``api`` as frames.

    On the Unix socket ``path`` (:meth:`start`: the local servicer) or on a bound TCP socket
    (:meth:`start_tcp`: the peer servicer, ``service`` and ``hello`` then name the peer API's).
    """

    def __init__(
        self, path: Path | None, api: object, *, limits: Mapping[str, float | None], token: str | None, mode: int,
        max_message_bytes: int, default_limit: float = 30.0, methods: Mapping[int, FastMethod] = METHODS,
        service: str = _SERVICE, hello: bytes = HELLO, name: str = "fast socket", hello_answer: bytes = b"",
        on_frame: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        #: Called as frames arrive, before they are read (kvxfer.server.busy_poll.BusyPoll.poke).
        self.on_frame = on_frame
        self.name = name
        self._token = token.encode() if token else None
        self._mode = mode
        self._hello_line = hello
        self.hello_answer = hello_answer  # a peer sidecar's instance id: what its reader checks it reached
        self.max_message_bytes = max_message_bytes
        self.methods = {
            n: _Method(
                getattr(api, snake_case(m.name)),
                f"/{service}/{m.name}",
                limits.get(m.name, default_limit),
                m.request,
                m.quiet,
            )
            for n, m in methods.items()
        }
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._tls = False
        self._closing = False
        self.calls_by_method: Counter[str] = Counter()  # hot calls that arrived here (not over gRPC)

    async def start(self) -> None:
        """Listen (the socket has its final mode before anyone can connect)."""
        assert self.path is not None
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                self.path.unlink()  # stale: the local API's own socket was checked for a live sidecar
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Nobody can connect to a bound socket before listen(): chmod in between leaves no
            # window, and unlike a umask it touches nothing another thread of this process creates.
            sock.bind(os.fspath(self.path))
            os.chmod(self.path, self._mode)
            sock.listen(128)
            sock.setblocking(False)
            self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), sock=sock)
        except BaseException:
            sock.close()
            raise

    async def start_tcp(self, sock: socket.socket, tls: ssl.SSLContext | None) -> None:
        """Serve on a bound TCP socket (bound early, so that its port is known before the handshakes)."""
        sock.listen(128)
        sock.setblocking(False)
        self._tls = tls is not None
        self._server = await asyncio.get_running_loop().create_server(lambda: _Connection(self), sock=sock, ssl=tls)

    async def close(self, grace: float = 0.0) -> None:
        """Stop listening; calls in flight get ``grace`` seconds to answer, then are cancelled.

        From now on a new call is refused (UNAVAILABLE) and a connection that still arrives is closed,
        as gRPC's ``stop(grace)`` refuses new calls at once.
        """
        self._closing = True
        if self._server is not None:
            self._server.close()
            self._server = None
            if self.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        tasks = [t for c in self._connections for t in c.calls.values()]
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)
        for c in list(self._connections):
            c.abandon()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def calls_started(self) -> int:
        """Hot calls that arrived here, every method."""
        return sum(self.calls_by_method.values())

    def check_hello(self, payload: bytes) -> KvxferError | None:
        """Why a hello is refused, or None."""
        if not payload.startswith(self._hello_line):
            return InvalidArgumentError(
                f"hello: not a kvxfer {self.name} client (the first frame must be the hello)", field="hello"
            )
        if self._token is None:
            return None
        got = payload[len(self._hello_line) :]
        if not got:
            return UnauthenticatedError(f"{self.name}: the hello carries no token", field="authorization")
        if not hmac.compare_digest(got, self._token):
            return UnauthenticatedError(f"{self.name}: the token in the hello is not valid", field="authorization")
        return None


class _Connection(asyncio.Protocol):
    """One worker connection: frames in, calls run as tasks, answers out in the order they finish."""

    def __init__(self, api: FastApi) -> None:
        self.api = api
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.greeted = False
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.auth = _NO_AUTH
        self._hello_timer: asyncio.TimerHandle | None = None
        #: Nothing is read from the connection (its client left WRITE_HIGH bytes of answers unread,
        #: or MAX_CALLS_IN_FLIGHT calls run): frames already here wait in ``buf``.
        self.held = False
        self._unread = False  # the transport's write buffer is over WRITE_HIGH (pause_writing)
        self._resuming = False  # a resume is scheduled
        self._started = 0  # calls started since reading last resumed (MAX_CALLS_PER_TURN)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        if self.api._closing:  # arrived (its TLS handshake done) after the listener closed
            self.transport.close()
            return
        self.transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        if self.api._tls:  # the TLS handshake, client certificate checked, is over by now
            self.auth = tls_auth_context(transport.get_extra_info("peercert"))
        self.api._connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_WITHIN_S, self._no_hello)

    def _no_hello(self) -> None:
        if not self.greeted and self.transport is not None:
            log.warning("connection closed: no hello", extra={"listener": self.api.name, "within_s": HELLO_WITHIN_S})
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.api._connections.discard(self)
        self.abandon()
        self.transport = None

    def abandon(self) -> None:
        """Cancel every call in flight (the client went away, or the sidecar stops)."""
        for task in self.calls.values():
            task.cancel()
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- flow control
    def pause_writing(self) -> None:
        """The client left more than WRITE_HIGH bytes of answers unread: read nothing more from it."""
        self._unread = True
        self._hold()

    def resume_writing(self) -> None:
        """Its answers are down to WRITE_LOW bytes."""
        self._unread = False
        self._schedule_resume()

    def _hold(self) -> None:
        if not self.held and self.transport is not None:
            self.held = True
            self.transport.pause_reading()

    def _schedule_resume(self) -> None:
        # Not from inside the transport's callback or a call's task: on the loop's next turn.
        if self.held and not self._resuming:
            self._resuming = True
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._resuming = False
        self._started = 0  # a turn of the loop went by: the calls started before it have run
        if not self.held or self._unread or len(self.calls) >= MAX_CALLS_IN_FLIGHT:
            return
        if self.transport is None or self.transport.is_closing():
            return
        self.held = False
        self._frames(time.monotonic())  # those that arrived before reading stopped
        if not self.held and self.transport is not None:
            self.transport.resume_reading()

    # ---------------------------------------------------------------- frames
    def data_received(self, data: bytes) -> None:
        arrived = time.monotonic()
        if self.api.on_frame is not None:
            self.api.on_frame()
        self.buf += data
        if not self.held:
            self._frames(arrived)

    def _frames(self, arrived: float) -> None:
        """Run the complete frames in ``buf`` until there are none, or reading stops."""
        buf = self.buf
        while (
            not self.held
            and self.transport is not None
            and not self.transport.is_closing()
            and len(buf) >= REQUEST.size
        ):
            n, call, method, timeout = REQUEST.unpack_from(buf, 0)
            limit = self.api.max_message_bytes if self.greeted else _MAX_HELLO
            if n > limit:
                self._refuse(call, ResourceExhaustedError(
                    f"frame: a payload of {n} bytes is over this sidecar's limit of {limit} bytes "
                    "(--max-message-bytes)", field="frame",
                ), close=True)  # fmt: skip
                return
            if len(buf) < REQUEST.size + n:
                return
            payload = bytes(buf[REQUEST.size : REQUEST.size + n])
            del buf[: REQUEST.size + n]
            if not self.greeted:
                self._hello(call, method, payload)
            elif method == CANCEL:
                self._cancel(call)
            else:
                self._start(call, method, timeout, payload, arrived)

    def _cancel(self, call: int) -> None:
        task = self.calls.get(call)
        if task is None:
            return
        task.cancel()
        coro = cast(Coroutine[Any, Any, None], task.get_coro())
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            # Cancelled before its first step: its body never runs, nor the finally that forgets it.
            del self.calls[call]

    def _hello(self, call: int, method: int, payload: bytes) -> None:
        why = self.api.check_hello(payload) if call == HELLO_CALL and method == 0 else InvalidArgumentError(
            "hello: the first frame of a connection must be the hello", field="hello"
        )  # fmt: skip
        if why is not None:
            self._refuse(call, why, close=True)
            return
        self.greeted = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._answer(call, 0, self.api.hello_answer)

    def _start(self, call: int, number: int, timeout: float, payload: bytes, arrived: float) -> None:
        if self.api._closing:
            self._refuse(call, UnavailableError(f"{self.api.name}: the sidecar is stopping", field="method"))
            return
        m = self.api.methods.get(number)
        if m is None:
            self._refuse(call, _UnimplementedError(f"method: the {self.api.name} has no method {number}",
                                                   field="method"))  # fmt: skip
            return
        if not math.isfinite(timeout) or timeout < 0:
            self._refuse(call, InvalidArgumentError(
                f"deadline: must be a finite number of seconds > 0, got {timeout}", field="deadline"
            ))  # fmt: skip
            return
        if call in self.calls or call == HELLO_CALL:
            self._refuse(call, InvalidArgumentError(f"call: id {call} is in use on this connection", field="call"))
            return
        try:
            req = parse_request(payload, m.request)
        except InvalidArgumentError as exc:
            self._refuse(call, exc)
            return
        task = asyncio.get_running_loop().create_task(self._run(call, m, req, _Context(timeout, self.auth), arrived))
        self.calls[call] = task
        self.api.calls_by_method[m.name] += 1
        self._started += 1
        if self._started >= MAX_CALLS_PER_TURN or len(self.calls) >= MAX_CALLS_IN_FLIGHT:
            # The next frame waits for the loop's next turn (after these calls' first steps), or
            # until a call ends.
            self._hold()
            self._schedule_resume()

    async def _run(self, call: int, m: _Method, req: Any, deadline: _Context, arrived: float) -> None:
        try:
            resp = await run_unary(m.fn, req, deadline, m.full, m.limit)
        except KvxferError as exc:
            if m.quiet:  # its caller did not wait: this log may be the only place the failure shows
                with log_context(request_id=getattr(req, "request_id", "") or None):
                    log.warning("quiet call failed", extra={
                        "method": m.full, "error": exc.message, "reason": exc.reason.value, "field": exc.field,
                    })  # fmt: skip
            self._answer(call, exc, b"")
        except asyncio.CancelledError:
            pass  # the client abandoned the call: nobody waits for an answer
        else:
            if not m.quiet:
                self._answer(call, 0, resp.SerializeToString())
        finally:
            self.calls.pop(call, None)
            if self.held:
                self._schedule_resume()
        if log.isEnabledFor(logging.DEBUG):  # the hop's share of a call (bench/gpu/sidecar_vram_bench.py --phases)
            log.debug("fast-socket call", extra={
                "method": m.full, "request_id": getattr(req, "request_id", ""), "arrived": arrived,
                "answered": time.monotonic(),
            })  # fmt: skip

    def _refuse(self, call: int, exc: KvxferError, *, close: bool = False) -> None:
        log.warning("frame refused", extra={"listener": self.api.name, "error": exc.message, "call": call})
        self._answer(call, exc, b"")
        if close and self.transport is not None:
            self.transport.close()

    def _answer(self, call: int, outcome: int | KvxferError, payload: bytes) -> None:
        if isinstance(outcome, KvxferError):
            status = status_message(outcome)
            code, payload = status.code, status.SerializeToString()
        elif len(payload) > self.api.max_message_bytes:
            # A client with the same limit would have to give up the whole connection for it (gRPC
            # fails only the call, the same way).
            self._answer(call, ResourceExhaustedError(
                f"answer: {len(payload)} bytes are over this sidecar's limit of {self.api.max_message_bytes} bytes "
                "(--max-message-bytes)", field="answer",
            ), b"")  # fmt: skip
            return
        else:
            code = outcome
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(ANSWER.pack(len(payload), call, code) + payload)
