"""Outgoing peer connections: one gRPC channel and one cached handshake per peer address.

A session is handshaken on first use and reused; it is dropped (and the peer re-handshaken on
next use) when a call to it fails at the transport level, when the peer's instance id changes
(it restarted) or when its registration epoch changes (its memory, hence its data-plane metadata,
changed). Concurrent first uses of one address share a single handshake. A peer not called for
:data:`IDLE_SECONDS` (and twice the longest transfer) is let go the same way, its channel closed.

A peer whose handshake names a frames address gets a frames connection too, opened in the
background after the handshake (:mod:`kvxfer.server.peer_frames`): from then on its hot calls go
as frames, everything else and everything before over gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from kvxfer.errors import (
    DeadlineError,
    FailedPreconditionError,
    KvxferError,
    NotFoundError,
    PeerUnavailableError,
    Reason,
)
from kvxfer.fastsock import FastHelloRefusedError
from kvxfer.logs import get_logger
from kvxfer.server.identity import Identity, describe_differences, reader_differences
from kvxfer.server.peer_frames import FramedStub, FramesDialer
from kvxfer.topology import RegionTable
from kvxfer.wire import peer_pb2, peer_pb2_grpc
from kvxfer.wire.status import error_from_status, error_of

__all__ = ["PeerDirectory", "PeerSession", "peer_error"]

T = TypeVar("T")
log = get_logger("kvxfer.server.peers")
#: Seconds after a failed attempt to open a peer's frames connection before the next.
FRAMES_RETRY_S = 5.0
#: A peer not called for this long (and for at least twice the longest transfer) is let go: its
#: session, channel, frames connection and data-plane peer. Prefill pods that were replaced would
#: otherwise stay loaded here for the sidecar's life (Mooncake keeps threads per peer).
IDLE_SECONDS = 600.0


@dataclass
class PeerSession:
    """A handshaken peer: its identity, the stub to call it and its data-plane name here."""

    address: str
    identity: Identity
    stub: Any
    dp_name: str
    my_epoch: int = 0  # this sidecar's registration epoch when it handshook (a new one needs a new handshake)
    alive: bool = True
    users: int = field(default=0)
    #: group -> its region table and memory type, checked at the session's first answer naming them
    regions: dict[str, tuple[RegionTable, str]] = field(default_factory=dict)


def peer_error(exc: grpc.aio.AioRpcError, address: str, what: str) -> KvxferError:
    """Turn a failed peer call into the sidecar error the worker sees (the peer's reason kept)."""
    code = exc.code()
    details = exc.details() or ""
    reason, field = error_from_status(code, details, exc.trailing_metadata())
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(details or f"{what} at peer {address}: not found", field=field or "request_id",
                             reason=reason)  # fmt: skip
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineError(f"{what} at peer {address} ran past its deadline", field="timeout_seconds")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return PeerUnavailableError(f"peer {address} is unreachable ({what}): {details}", field="remote_addresses")
    out = error_of(code, f"{what} at peer {address}: {details}", reason.value, "remote_addresses")
    return out


class PeerDirectory:
    """Sessions to the peers this sidecar reads from."""

    def __init__(
        self,
        *,
        me: Callable[[], Identity],
        load_peer: Callable[[bytes], str],
        forget_peer: Callable[[str], None],
        channel_options: Sequence[tuple[str, Any]],
        credentials: grpc.ChannelCredentials | None,
        metadata: tuple[tuple[str, str], ...],
        on_handshake: Callable[[str], None],
        handshake_timeout: float = 10.0,
        frames: FramesDialer | None = None,
        longest_transfer: float = 0.0,
    ) -> None:
        self._me = me
        self._load_peer = load_peer
        self._forget_peer = forget_peer
        self._options = list(channel_options)
        self._credentials = credentials
        self.metadata = metadata
        self._on_handshake = on_handshake
        self._timeout = handshake_timeout
        self._sessions: dict[str, PeerSession] = {}
        self._pending: dict[str, asyncio.Future[PeerSession]] = {}  # handshakes under way, by address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, peer_pb2_grpc.PeerAsyncStub] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._dialer = frames
        self._frames: dict[str, FramedStub] = {}  # by address: open frames connections
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._frames_retry: dict[str, float] = {}  # by address: no new attempt before this time
        self._closed = False
        #: How long a peer may go uncalled before it is let go (see IDLE_SECONDS).
        self.idle_seconds = max(IDLE_SECONDS, 2 * longest_transfer)
        self._used: dict[str, float] = {}  # by address: when it was last called (or handshaken)
        self._sweep: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def stub(self, address: str) -> peer_pb2_grpc.PeerAsyncStub:
        """The Peer stub on the (shared) channel to ``address``."""
        self._touch(address)
        # A stub builds one callable per method: made once per channel, not on every call of the hot path.
        stub = self._stubs.get(address)
        if stub is None:
            if self._credentials is not None:
                ch = grpc.aio.secure_channel(address, self._credentials, options=self._options)
            else:
                ch = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = ch
            stub = self._stubs[address] = peer_pb2_grpc.PeerStub(ch)
        return stub

    async def session(self, address: str, *, budget: float | None = None) -> PeerSession:
        """The handshaken session to ``address`` (handshaking now if there is none)."""
        self._touch(address)
        s = self._sessions.get(address)
        if s is not None and s.alive and s.my_epoch == self._me().epoch:
            return s
        fut = self._pending.get(address)
        if fut is None:
            # The handshake is a task of its own: a caller that is cancelled (its pull aborted) must not
            # take the handshake down with it for the others waiting on it.
            fut = asyncio.ensure_future(self._handshake(address, budget))
            self._pending[address] = fut

            def forget(done: asyncio.Future[PeerSession]) -> None:
                if self._pending.get(address) is done:
                    del self._pending[address]
                if not done.cancelled():
                    done.exception()  # retrieved: every waiter may be gone

            fut.add_done_callback(forget)
        return await asyncio.shield(fut)

    async def _handshake(self, address: str, budget: float | None) -> PeerSession:
        me = self._me()
        stub = self.stub(address)
        try:
            resp = await stub.Handshake(
                peer_pb2.HandshakeRequest(info=me.to_proto()),
                timeout=min(budget or self._timeout, self._timeout),
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            self._on_handshake("refused" if refused else "failed")
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.invalidate(address, reconnect=True)
            if refused:  # the publisher's reason: INCOMPATIBLE_PEER, or NOT_REGISTERED (its worker is not up yet)
                reason, _ = error_from_status(exc.code(), exc.details() or "", exc.trailing_metadata())
                if reason is Reason.INTERNAL:  # none given (an older peer): a refusal
                    reason = Reason.INCOMPATIBLE_PEER
                raise FailedPreconditionError(
                    f"handshake with {address} refused: {exc.details()}", field="remote_addresses", reason=reason,
                ) from None  # fmt: skip
            raise peer_error(exc, address, "handshake") from None
        try:
            them = Identity.from_proto(resp.info, "handshake.info")
        except Exception as exc:
            self._on_handshake("failed")
            raise PeerUnavailableError(
                f"peer {address} sent a bad handshake: {exc}", field="remote_addresses", reason=Reason.PEER_INPUT
            ) from None
        diffs = reader_differences(me, them)
        if diffs:
            self._on_handshake("refused")
            raise FailedPreconditionError(
                f"incompatible peer {them.label} at {address} (local = this sidecar, remote = the peer): "
                + describe_differences(diffs),
                field="remote_addresses",
                reason=Reason.INCOMPATIBLE_PEER,
            )
        try:
            dp_name = self._load_peer(them.metadata)
        except Exception:
            self._on_handshake("failed")
            raise
        old = self._sessions.get(address)
        if old is not None and old.dp_name != dp_name:
            self._forget_peer(old.dp_name)
        s = PeerSession(address, them, stub, dp_name, me.epoch)
        self._sessions[address] = s
        self._on_handshake("ok")
        log.info("handshake ok", extra={"peer": them.label, "address": address, "epoch": them.epoch})
        self._connect_frames(address, them)
        return s

    def _connect_frames(self, address: str, them: Identity) -> None:
        """Open a frames connection to a peer that offers one, in the background (calls use gRPC meanwhile).

        After a failed attempt the next waits :data:`FRAMES_RETRY_S`: a peer whose frames cannot be
        reached is not dialled (and logged) on every call.
        """
        if self._dialer is None or self._closed or not them.frames_address or address in self._opening:
            return
        framed = self._frames.get(address)
        if framed is not None and not framed.closed:
            return
        if time.monotonic() < self._frames_retry.get(address, 0.0):
            return
        task = asyncio.get_running_loop().create_task(self._open_frames(self._dialer, address, them))
        self._opening[address] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._opening.get(address) is t:
                del self._opening[address]

        task.add_done_callback(done)

    async def _open_frames(self, dialer: FramesDialer, address: str, them: Identity) -> None:
        try:
            channel = await dialer.open(address, them.frames_address, them.instance_id)
        except (OSError, TimeoutError, FastHelloRefusedError) as exc:
            self._frames_retry[address] = time.monotonic() + FRAMES_RETRY_S
            log.warning("peer frames not used for now; its hot calls go over gRPC", extra={
                "peer": them.label, "address": address, "frames_address": them.frames_address,
                "error": str(exc) or type(exc).__name__})  # fmt: skip
            return
        s = self._sessions.get(address)
        if self._closed or s is None or not s.alive or s.identity.instance_id != them.instance_id:
            channel.close()  # the session it was opened for is gone: the next handshake opens another
            return
        old = self._frames.get(address)
        if old is not None:
            old.close()
        self._frames[address] = FramedStub(channel, self.stub(address))

    def invalidate(self, address: str, *, reconnect: bool = False, session: PeerSession | None = None) -> None:
        """Drop the session to ``address``; the next use handshakes again.

        With ``reconnect`` the channel is replaced too: a channel whose peer died sits in gRPC's
        reconnect backoff (up to minutes) and would fail calls fast even after the peer is back.
        ``session``: only if that is still the session to ``address`` (a failure on a session that a
        newer handshake already replaced says nothing about the newer one).
        """
        current = self._sessions.get(address)
        if session is not None and current is not None and current is not session:
            return  # by identity: sessions are dataclasses, and two of one peer can compare equal
        s = self._sessions.pop(address, None)
        if s is not None:
            s.alive = False
            self._forget_peer(s.dp_name)
        if reconnect:
            framed = self._frames.pop(address, None)
            if framed is not None:
                framed.close()
            opening = self._opening.pop(address, None)
            if opening is not None:
                opening.cancel()
            self._stubs.pop(address, None)
            ch = self._channels.pop(address, None)
            if ch is not None:
                task = asyncio.get_running_loop().create_task(ch.close(grace=None))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def _touch(self, address: str) -> None:
        self._used[address] = time.monotonic()
        if self._sweep is None and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.idle_seconds / 4, self._let_go_idle)

    def _let_go_idle(self) -> None:
        """Let go of the peers not called for ``idle_seconds``; re-armed while any peer is left."""
        self._sweep = None
        horizon = time.monotonic() - self.idle_seconds
        for address in [a for a, at in self._used.items() if at < horizon and a not in self._pending]:
            del self._used[address]
            self._frames_retry.pop(address, None)
            if address in self._sessions or address in self._channels:
                log.info("idle peer let go", extra={"address": address, "idle_seconds": self.idle_seconds})
                self.invalidate(address, reconnect=True)
        if self._used and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.idle_seconds / 4, self._let_go_idle)

    def sessions(self) -> list[PeerSession]:
        """Live sessions."""
        return list(self._sessions.values())

    async def call(self, address: str, what: str, fn: Callable[[peer_pb2_grpc.PeerAsyncStub], Awaitable[T]]) -> T:
        """Run ``fn(stub)``; transport failures invalidate the session and become sidecar errors."""
        stub: Any = self.stub(address)
        framed = self._frames.get(address)
        if framed is not None:
            if framed.closed:  # lost (the peer closed it or went away): gRPC, and dial again
                del self._frames[address]
                s = self._sessions.get(address)
                if s is not None and s.alive:
                    self._connect_frames(address, s.identity)
                framed = None
            else:
                stub = framed
        try:
            return await fn(stub)
        except grpc.aio.AioRpcError as exc:
            # A call on a frames connection that another call's failure already replaced fails
            # with it, as gRPC's calls on a channel closed under them do: it does not reset the
            # replacement (the channel, handshake and connection built since) in turn.
            current = framed is None or self._frames.get(address) is framed
            if current and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.invalidate(address, reconnect=True)
            raise peer_error(exc, address, what) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller was cancelled
            # grpc.aio cancels the calls in flight on a channel that is closed under them (another
            # call to this peer failed and reset it): a peer failure, not a cancellation of ours.
            raise PeerUnavailableError(
                f"peer {address} is unreachable ({what}): its channel was reset while the call was in flight",
                field="remote_addresses",
            ) from None

    def framed(self, address: str) -> bool:
        """True while a frames connection to ``address`` is open (its hot calls go as frames)."""
        f = self._frames.get(address)
        return f is not None and not f.closed

    def current(self, address: str) -> PeerSession | None:
        """The live session to ``address``, if any."""
        return self._sessions.get(address)

    async def close(self) -> None:
        """Close every channel."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for addr in list(self._sessions):
            self.invalidate(addr)
        for task in list(self._opening.values()):
            task.cancel()
        for framed in self._frames.values():
            framed.close()
        self._frames.clear()
        channels, self._channels = list(self._channels.values()), {}
        self._stubs.clear()
        for ch in channels:
            await ch.close()
