"""A worker hands the file descriptors of its KV memory to its sidecar (SCM_RIGHTS on a Unix socket).

A CPU worker whose cache already lives in memory that other processes cannot name (vLLM allocates
one ``torch.zeros`` buffer and views every layer of every cache group into it) moves that buffer
into shared memory *in place* (``UntypedStorage._share_fd_cpu_``: every view keeps working, the
file is unlinked at once, so nothing is left in ``/dev/shm`` whatever way the worker exits) and
passes the descriptor to its sidecar, which maps the same pages. gRPC cannot carry descriptors, so
the sidecar listens on a second Unix socket beside its local API socket
(:func:`fd_socket_path`): one message of JSON (``{"token": ...}``) with the descriptors attached,
answered by one JSON line (``{"handle": ...}`` or ``{"error": ..., "code": ...}``). The worker keeps
the connection open for as long as the sidecar may use the memory; ``RegisterCaches`` names the
handle (:class:`kvxfer.memory.FdMemoryRef`), and the sidecar forgets the descriptors when the
connection closes.

The sidecar reads each hello on its event loop (no thread: the default executor is shared with the
streamer's GPU event waits), within ``_HELLO_TIMEOUT_S``. A worker says hello as it connects, so
only a silent connection waits: beyond :data:`MAX_WAITING_HELLOS` of them, the one that waited
longest is answered RESOURCE_EXHAUSTED and closed, and no silent connection delays a worker's
hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import secrets
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from kvxfer.errors import KvxferError, Reason
from kvxfer.logs import get_logger

__all__ = ["FdBox", "FdLease", "FdPassError", "fd_socket_path", "send_fds"]

log = get_logger("kvxfer.fdpass")
#: Appended to the local API's socket path to name the descriptor socket next to it.
FD_SOCKET_SUFFIX = ".fds"
MAX_FDS = 64
_MAX_HELLO = 16 * 1024
_HELLO_TIMEOUT_S = 10.0
#: Connections that have not said hello yet; one more closes the one that waited longest.
MAX_WAITING_HELLOS = 32


class FdPassError(KvxferError):
    """Descriptors could not be handed over; the message says why (and names the socket)."""

    status = "UNAVAILABLE"
    default_reason = Reason.SIDECAR_UNREACHABLE


def fd_socket_path(local_socket: str | os.PathLike[str]) -> Path:
    """The descriptor socket that sits beside a sidecar's local API socket."""
    p = Path(os.fspath(local_socket).removeprefix("unix://").removeprefix("unix:"))
    return p.with_name(p.name + FD_SOCKET_SUFFIX)


# ---------------------------------------------------------------------------- worker side
@dataclass
class FdLease:
    """The open connection that keeps the sidecar's copy of the descriptors alive."""

    handle: str
    sizes: tuple[int, ...]
    sock: socket.socket | None = field(repr=False, default=None)

    def close(self) -> None:
        """Let the sidecar forget the descriptors (mappings it already made stay valid)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


def send_fds(path: str | os.PathLike[str], fds: Sequence[int], *, token: str | None = None,
             timeout: float = _HELLO_TIMEOUT_S) -> FdLease:  # fmt: skip
    """Hand ``fds`` to the sidecar listening at ``path``; returns the lease naming them.

    With no descriptors the lease only says the worker is alive (``RegisterCaches.worker_lease``):
    the kernel closes the connection when the process exits, however it exits.
    """
    if not 0 <= len(fds) <= MAX_FDS:
        raise FdPassError(f"fds: at most {MAX_FDS} descriptors can be passed, got {len(fds)}", field="fds")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(os.fspath(path))
        except OSError as exc:
            raise FdPassError(
                f"sidecar_socket: cannot reach the sidecar's descriptor socket {os.fspath(path)!r}: "
                f"{exc.strerror or exc} (is the sidecar running with --local-socket, and the socket's directory "
                "shared with the worker?)",
                field="sidecar_socket",
            ) from None
        hello = json.dumps({"v": 1, "token": token or ""}).encode() + b"\n"
        socket.send_fds(sock, [hello], list(fds))
        answer = _read_line(sock)
        try:
            reply = json.loads(answer)
        except ValueError:
            raise FdPassError(f"sidecar_socket: unreadable answer {answer[:200]!r}", field="sidecar_socket") from None
        if "error" in reply:
            raise FdPassError(f"sidecar_socket: the sidecar refused the descriptors: {reply['error']}",
                              field="sidecar_socket")  # fmt: skip
        sock.settimeout(None)
        return FdLease(str(reply["handle"]), tuple(int(s) for s in reply.get("sizes", ())), sock)
    except BaseException:
        sock.close()
        raise


def _read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > _MAX_HELLO:
            break
    return buf.strip()


# ---------------------------------------------------------------------------- sidecar side
@dataclass
class _Entry:
    fds: tuple[int, ...]
    sizes: tuple[int, ...]
    pid: int
    uid: int


class FdBox:
    """Sidecar side: accepts descriptors on a Unix socket and keeps them while their sender is connected.

    ``on_gone(handle)`` is called when a sender disconnects (its process exited or closed the
    lease); the descriptors are closed right after.
    """

    def __init__(self, path: Path, *, token: str | None = None, mode: int = 0o660,
                 on_gone: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.path = path
        self._token = token
        self._mode = mode
        self._on_gone = on_gone
        self._entries: dict[str, _Entry] = {}
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        #: Connections whose hello has not come yet, oldest first (at most MAX_WAITING_HELLOS).
        self._waiting: dict[asyncio.Task[None], socket.socket] = {}

    async def start(self) -> None:
        """Listen (the socket has its final mode before anyone can connect)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Nobody can connect to a bound socket before listen(): chmod in between leaves no window,
        # and unlike a umask it touches nothing another thread of this process creates meanwhile.
        sock.bind(os.fspath(self.path))
        os.chmod(self.path, self._mode)
        sock.listen(64)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        """Stop listening, drop every connection and close every descriptor."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for handle in list(self._entries):
            self._drop(handle)

    def fds(self, handle: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(descriptors, their sizes, sender pid) of a live handle; KeyError when unknown or gone."""
        e = self._entries[handle]
        return e.fds, e.sizes, e.pid

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
            # Closed once the task is done, even one cancelled before it ran (its finally never runs).
            task.add_done_callback(functools.partial(_close, conn))
            self._waiting[task] = conn
            # Its first step reads a hello that is there already: only silent connections wait.
            await asyncio.sleep(0)
            if len(self._waiting) > MAX_WAITING_HELLOS:
                self._evict(*next(iter(self._waiting.items())))

    def _evict(self, task: asyncio.Task[None], conn: socket.socket) -> None:
        """Close the connection that waited longest for its hello: more than MAX_WAITING_HELLOS wait."""
        del self._waiting[task]
        message = (f"too many connections ({MAX_WAITING_HELLOS}) are waiting to say hello on the descriptor socket; "
                   "this one waited longest and is closed (say hello as you connect, then retry)")  # fmt: skip
        log.warning("descriptor socket: a silent connection closed", extra={"waiting": MAX_WAITING_HELLOS})
        with contextlib.suppress(OSError):  # a few bytes into an idle socket's buffer: never blocks
            conn.send(json.dumps({"error": message, "code": "RESOURCE_EXHAUSTED"}).encode() + b"\n")
        task.cancel()

    async def _serve(self, conn: socket.socket) -> None:
        handle = ""
        loop = asyncio.get_running_loop()
        try:
            pid, uid, _gid = _peer_credentials(conn)
            try:
                async with asyncio.timeout(_HELLO_TIMEOUT_S):
                    data, fds = await _recv_hello(loop, conn)
            except TimeoutError:
                log.warning("descriptor socket: no hello in time; closed", extra={"pid": pid,
                            "within_s": _HELLO_TIMEOUT_S})  # fmt: skip
                return
            except OSError:
                return
            finally:
                self._waiting.pop(cast("asyncio.Task[None]", asyncio.current_task()), None)
            reply, handle = self._admit(data, fds, pid, uid)
            await loop.sock_sendall(conn, json.dumps(reply).encode() + b"\n")
            if not handle:
                return
            # The lease lasts as long as the connection: wait for the sender to go away.
            while await loop.sock_recv(conn, 4096):
                pass
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            conn.close()
            if handle:
                log.info("worker closed its memory descriptors", extra={"handle": handle})
                if self._on_gone is not None:
                    self._on_gone(handle)
                self._drop(handle)

    def _admit(self, data: bytes, fds: list[int], pid: int, uid: int) -> tuple[dict[str, object], str]:
        def refuse(message: str, code: str) -> tuple[dict[str, object], str]:
            for fd in fds:
                os.close(fd)
            log.warning("descriptors refused", extra={"error": message, "pid": pid})
            return {"error": message, "code": code}, ""

        try:
            hello = json.loads(data.decode())
            token = str(hello.get("token", ""))
        except (ValueError, UnicodeDecodeError, AttributeError):
            return refuse("the message is not a JSON object", "INVALID_ARGUMENT")
        if self._token and not hmac.compare_digest(token.encode(), self._token.encode()):
            return refuse("token: missing or wrong", "UNAUTHENTICATED")
        sizes = []
        for fd in fds:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                return refuse("fds: every descriptor must be a non-empty shared-memory file", "INVALID_ARGUMENT")
            sizes.append(int(st.st_size))
        handle = secrets.token_hex(16)
        self._entries[handle] = _Entry(tuple(fds), tuple(sizes), pid, uid)
        log.info("worker memory descriptors received", extra={"handle": handle, "pid": pid, "bytes": sum(sizes)})
        return {"handle": handle, "sizes": sizes}, handle

    def _drop(self, handle: str) -> None:
        e = self._entries.pop(handle, None)
        for fd in e.fds if e else ():
            with contextlib.suppress(OSError):
                os.close(fd)


async def _recv_hello(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors it carries, read from a non-blocking socket by the event loop."""
    fd = conn.fileno()
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_HELLO, MAX_FDS)
            return data, list(fds)
        except (BlockingIOError, InterruptedError):
            pass
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _close(conn: socket.socket, _task: object) -> None:
    conn.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # the socket may be reported readable again before the reader is removed
        fut.set_result(None)


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    import struct

    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
