"""The hot calls of a blocking caller on its own thread: one fast-socket connection per thread.

:class:`kvxfer.client.Client` runs every call on its event-loop thread, which costs two thread
hand-offs per call. For ``pull`` and ``publish``, the calls a synchronous worker makes on its
critical path, the calling thread instead uses its own blocking connection to the sidecar's fast
socket (:class:`kvxfer.fastsock.BlockingFastConnection`): the same frames, deadline, token and
errors. When the sidecar serves no fast socket, or it cannot be reached, the call goes the usual
way (the loop thread, which falls back to gRPC) and this path is tried again later.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError, Message

from kvxfer.client.types import KvxferRpcError
from kvxfer.errors import Reason
from kvxfer.fastsock import BlockingFastConnection, FastCallError, FastHelloRefusedError
from kvxfer.logs import get_logger
from kvxfer.wire.frames import FastMethod
from kvxfer.wire.status import error_from_status_message

__all__ = ["ThreadCalls", "decode_answer", "lost_error", "timeout_error"]

log = get_logger("kvxfer.client")

#: After the fast socket could not be reached, the blocking path waits this long before trying it again.
RETRY_SECONDS = 5.0


def decode_answer(method: FastMethod, code: int, payload: bytes) -> Message:
    """The response of a fast-socket answer, or the :class:`KvxferRpcError` it carries."""
    try:
        if code == 0:
            return method.response.FromString(payload)
        status, message, reason, field = error_from_status_message(payload)
    except DecodeError as exc:  # not what a sidecar sends: say so rather than guess
        raise KvxferRpcError(
            grpc.StatusCode.INTERNAL, f"unreadable answer on the fast socket (status {code}): {exc}", method.name
        ) from None
    raise KvxferRpcError(status, message, method.name, reason=reason, field=field)


def lost_error(method: FastMethod, exc: FastCallError) -> KvxferRpcError:
    """A call that was sent when its connection failed: it may have started, so it fails as an
    unreachable sidecar fails it over gRPC (UNAVAILABLE, SIDECAR_UNREACHABLE), never retried on another path."""
    return KvxferRpcError(grpc.StatusCode.UNAVAILABLE, str(exc), method.name, reason=Reason.SIDECAR_UNREACHABLE)


def timeout_error(method: FastMethod) -> KvxferRpcError:
    """What grpc.aio reports for a call past its deadline."""
    return KvxferRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", method.name, reason=Reason.DEADLINE)


class ThreadCalls:
    """Per-thread blocking connections to one fast socket (see the module docs)."""

    def __init__(self, path: Path | None, *, token: str | None, connect_timeout: float, max_message_bytes: int) -> None:
        self.path = path
        self._token = token
        self._connect_timeout = connect_timeout
        self._max_message_bytes = max_message_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weak: a thread's connection goes (and closes) with the thread; close() reaches the rest.
        self._open: weakref.WeakSet[BlockingFastConnection] = weakref.WeakSet()
        self._retry_at = 0.0 if path is not None else math.inf
        self._closed = False

    @property
    def active(self) -> bool:
        """True while some thread has an open connection."""
        with self._lock:
            return any(not c.closed for c in self._open)

    def call(
        self, method: FastMethod, req: Message, timeout: float, *, while_waiting: Callable[[], None] | None = None,
        spin_s: float = 0.0,
    ) -> Message | None:  # fmt: skip
        """The call's response over this thread's connection; None: it was not sent, use the usual way.

        ``while_waiting`` and ``spin_s``: as for :meth:`BlockingFastConnection.call`.
        """
        conn = self._connection()
        if conn is None:
            return None
        try:
            code, payload = conn.call(method.number, req.SerializeToString(), timeout, while_waiting=while_waiting,
                                      spin_s=spin_s)  # fmt: skip
        except TimeoutError:
            raise timeout_error(method) from None
        except FastCallError as exc:
            self._forget(conn)
            if not exc.sent:
                return None  # nothing started in the sidecar: the usual way may carry it
            raise lost_error(method, exc) from None
        return decode_answer(method, code, payload)

    def post(self, method: FastMethod, req: Message, timeout: float) -> bool:
        """Send ``req`` on this thread's connection without waiting for the answer; False: not sent."""
        conn = self._connection()
        if conn is None:
            return False
        try:
            conn.post(method.number, req.SerializeToString(), timeout)
        except FastCallError:
            self._forget(conn)
            return False
        return True

    def _connection(self) -> BlockingFastConnection | None:
        conn: BlockingFastConnection | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        if self._closed or time.monotonic() < self._retry_at:
            return None
        assert self.path is not None
        try:
            conn = BlockingFastConnection.open(self.path, token=self._token, timeout=self._connect_timeout,
                                               max_message_bytes=self._max_message_bytes)  # fmt: skip
        except (OSError, TimeoutError) as exc:
            log.debug("fast socket unavailable to this thread; using the client's loop",
                      extra={"socket": str(self.path), "error": str(exc)})  # fmt: skip
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return None
        except FastHelloRefusedError:
            self._retry_at = math.inf  # refused (a wrong token): the usual way reports the refusal on every call
            return None
        with self._lock:
            if self._closed:
                conn.close()
                return None
            self._open.add(conn)
        self._local.conn = conn
        return conn

    def _forget(self, conn: BlockingFastConnection) -> None:
        conn.close()
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Close every thread's connection; later calls take the usual way (and fail as it does)."""
        with self._lock:
            self._closed = True
            conns, self._open = list(self._open), weakref.WeakSet()
        for c in conns:
            c.close()
