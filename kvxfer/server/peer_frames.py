"""The peer API's hot calls as frames between sidecars (format: :mod:`kvxfer.wire.frames`, ``PEER_METHODS``).

A pull's lookup (``GetPublished``/``GetPublishedBatch``), its completion notice (``Notify``/
``NotifyBatch``) and the holds of queued requests (``Hold``) cost each side of a grpc.aio call
~0.9 ms of CPU on a two-core host, about half of what both sidecars spend per pull under load;
the same messages as frames on a TCP connection cost ~0.08 ms. Everything else between sidecars
(the handshake, aborts, push) stays on gRPC, which also remains the fallback.

Reading path: :class:`PeerFramesServer` (the publisher's side: a :class:`kvxfer.server.fast_api.FastApi`
over the peer servicer on a TCP port of the peer API's host), then :class:`FramedStub` (the reader's
side, used by :class:`kvxfer.server.peers.PeerDirectory` once a connection is open).

Rules that keep it as safe as the gRPC API it shortcuts:

* **Same credentials.** Under the peer API's TLS the connection is TLS with the same certificate,
  key and CA; with ``--tls-ca`` a client certificate is required, and its URI names are the caller's
  credentials for every call on the connection (as gRPC's auth context gives them). The cluster's
  token, if any, is the hello's: a connection that does not present it gets nothing.
* **Same sidecar.** A reader connects only to a frames address on the host it dialed for the
  handshake (the address its own worker named), and keeps the connection only if the sidecar that
  answers its hello is the instance it handshook with: a peer cannot send it elsewhere. Under TLS
  the server certificate is checked against that host, as gRPC checks it.
* **Same answers.** Calls run through the very servicer methods gRPC calls, under the same limits;
  a failure reaches the reader as the ``grpc.aio.AioRpcError`` gRPC would raise (code, message and
  the ``ErrorInfo`` with reason and field), so callers cannot tell the paths apart.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from kvxfer.addresses import parse_address
from kvxfer.config import ConfigError, Settings
from kvxfer.fastsock import FastCallError, FastChannel
from kvxfer.server.fast_api import FastApi
from kvxfer.wire import peer_pb2
from kvxfer.wire.frames import PEER_HELLO, PEER_METHODS, FastMethod
from kvxfer.wire.status import DETAILS_KEY, status_code

__all__ = ["FramedStub", "FramesDialer", "PeerFramesServer", "client_tls", "same_host"]

_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
_BY_NAME: dict[str, FastMethod] = {m.name: m for m in PEER_METHODS.values()}


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The peer API's TLS for the frames listener (None without ``--tls-cert``)."""
    if not settings.tls_enabled:
        return None
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    if settings.tls_ca is not None:  # mutual TLS: as the gRPC server, no client certificate, no connection
        ctx.load_verify_locations(cafile=settings.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls(settings: Settings) -> ssl.SSLContext | None:
    """What a reader presents and checks on a peer's frames connection (None without ``--tls-cert``)."""
    if not settings.tls_enabled:
        return None
    assert settings.tls_cert is not None
    assert settings.tls_key is not None
    ctx = ssl.create_default_context(cafile=settings.tls_ca)  # the system's roots without --tls-ca, as gRPC
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
    return ctx


class PeerFramesServer:
    """The frames listener beside the peer API: bound at construction (its address goes in the handshake)."""

    def __init__(
        self, settings: Settings, api: object, *, limits: Mapping[str, float | None], token: str | None,
        instance_id: str, on_frame: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        host, _ = settings.peer_host_port
        try:  # before binding: a bad certificate leaks no socket
            self._tls = server_tls(settings)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tls-cert/--tls-key/--tls-ca: the peer frames listener cannot use them: {exc}",
                              field="tls_cert") from None  # fmt: skip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, settings.peer_frames_port))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"--peer-frames-port: cannot listen on {host}:{settings.peer_frames_port}: {exc}",
                              field="peer_frames_port") from None  # fmt: skip
        self.port: int = self._sock.getsockname()[1]
        #: What peers are told to dial (the peer API's advertised host, this port).
        self.address = settings.advertise_address(self.port)
        self.api = FastApi(
            None, api, limits=limits, token=token, mode=0, max_message_bytes=settings.max_message_bytes,
            methods=PEER_METHODS, service=_SERVICE, hello=PEER_HELLO, name="peer frames listener",
            hello_answer=instance_id.encode(), on_frame=on_frame,
        )  # fmt: skip

    async def start(self) -> None:
        """Serve."""
        await self.api.start_tcp(self._sock, self._tls)

    async def close(self, grace: float = 0.0) -> None:
        """Stop listening; calls in flight get ``grace`` seconds."""
        await self.api.close(grace)
        self._sock.close()


def same_host(dialed: str, frames_address: str) -> tuple[str, int] | None:
    """(host, port) of a peer's frames address when it is on the host dialed for its handshake, else None."""
    try:
        host, _ = parse_address(dialed, setting="remote_addresses")
        f_host, f_port = parse_address(frames_address, setting="frames_address")
    except ConfigError:
        return None
    return (f_host, f_port) if f_host == host and f_port > 0 else None


@dataclass(frozen=True)
class FramesDialer:
    """How this sidecar connects to its peers' frames: its TLS, its token, the message limit."""

    tls: ssl.SSLContext | None
    token: str | None
    max_message_bytes: int
    timeout: float = 5.0
    #: The name the peer's certificate must carry (``--tls-server-name``; None: the host dialed).
    server_name: str | None = None

    @classmethod
    def of(cls, settings: Settings) -> FramesDialer | None:
        """From the sidecar's settings (None with ``--peer-frames false``: gRPC only)."""
        if not settings.peer_frames:
            return None
        return cls(client_tls(settings), settings.token(), settings.max_message_bytes,
                   server_name=settings.tls_server_name)  # fmt: skip

    async def open(self, dialed: str, frames_address: str, instance_id: str) -> FastChannel:
        """A frames connection to the peer instance ``instance_id`` handshaken at ``dialed``.

        OSError, TimeoutError or FastHelloRefusedError when there is none: the address is not on the
        host dialed, nobody answers there, the hello is refused, or the sidecar that answers is
        another instance (another sidecar of that host, or the peer restarted since its handshake).
        """
        where = same_host(dialed, frames_address)
        if where is None:
            raise OSError(f"its frames address {frames_address!r} is not on the host dialed ({dialed!r})")
        host, port = where
        ch = await FastChannel.open_tcp(host, port, tls=self.tls, hello=PEER_HELLO, token=self.token,
                                        timeout=self.timeout, max_message_bytes=self.max_message_bytes,
                                        server_name=self.server_name)  # fmt: skip
        if ch.hello_answer != instance_id.encode():
            ch.close()
            answered = ch.hello_answer.decode(errors="replace")
            raise OSError(f"{frames_address} answered as instance {answered!r}, not the handshake's {instance_id!r}")
        return ch


def _rpc_error(code: grpc.StatusCode, message: str, status: bytes | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((DETAILS_KEY, status)) if status else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


class FramedStub:
    """One frames connection to a peer, as a Peer stub: its hot methods as frames, the rest over ``stub``.

    ``stub`` is the gRPC stub of the same address; the two are replaced together (a reconnect drops
    both). A call the connection could not send goes over gRPC instead; one it sent and lost fails
    as UNAVAILABLE, a passed deadline as DEADLINE_EXCEEDED, as they would over gRPC.
    """

    def __init__(self, channel: FastChannel, stub: Any) -> None:
        self.channel = channel
        self._stub = stub
        self._methods = {name: self._method(m) for name, m in _BY_NAME.items()}

    @property
    def closed(self) -> bool:
        """True once the connection is gone (the peer died or the sidecar closed it)."""
        return self.channel.closed

    def close(self) -> None:
        """Close the connection; calls in flight fail as UNAVAILABLE."""
        self.channel.close()

    def __getattr__(self, name: str) -> Any:
        method = self._methods.get(name)
        return method if method is not None else getattr(self._stub, name)

    def _method(self, m: FastMethod) -> Callable[..., Awaitable[Any]]:
        async def call(req: Any, *, timeout: float | None = None, metadata: Any = None) -> Any:
            if timeout is None:  # the hot calls always have a deadline; a frame's timeout 0 would mean none
                return await getattr(self._stub, m.name)(req, timeout=timeout, metadata=metadata)
            try:
                code, body = await self.channel.call(m.number, req.SerializeToString(), timeout)
            except FastCallError as exc:
                if not exc.sent:
                    return await getattr(self._stub, m.name)(req, timeout=timeout, metadata=metadata)
                raise _rpc_error(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            except TimeoutError:
                raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            try:
                if code == 0:
                    return m.response.FromString(body)
                status = status_pb2.Status.FromString(body)
            except DecodeError as exc:  # as gRPC fails an answer its deserializer cannot read
                raise _rpc_error(grpc.StatusCode.INTERNAL, f"a {m.name} answer that does not parse: {exc}") from None
            raise _rpc_error(status_code(code), status.message, body)

        return call
