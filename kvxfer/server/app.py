"""The sidecar process: gRPC servers (peer + local), health, reflection, metrics, signals, drain.

:class:`Sidecar` runs inside any asyncio loop (tests and library mode start several in one
process); :func:`serve_main` is ``kvxfer serve``: uvloop, SIGTERM/SIGINT -> graceful drain -> exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer import PROTOCOL_VERSION, __version__
from kvxfer._proto.kvxfer.v1 import local_pb2, peer_pb2
from kvxfer.config import ConfigError, Settings, parse_address
from kvxfer.errors import KvxferError
from kvxfer.fdpass import FdBox, fd_socket_path
from kvxfer.logs import adopt_logger, configure_logging, get_logger
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.core import SidecarCore
from kvxfer.server.dataplane import DataPlane, create_data_plane
from kvxfer.server.rpc import TokenInterceptor, service_handler
from kvxfer.transport import transport_class

__all__ = ["HEALTH_SERVICES", "Sidecar", "serve_main"]

log = get_logger("kvxfer.server")
LOCAL_SERVICE = local_pb2.DESCRIPTOR.services_by_name["Local"]
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"]
HEALTH_SERVICES = ("", PEER_SERVICE.full_name, LOCAL_SERVICE.full_name)
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _LocalApi:
    """Local service methods: unwrap the call and hand it to the core."""

    def __init__(self, core: SidecarCore) -> None:
        self.core = core

    async def register_caches(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.register_caches(req)

    async def publish(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.publish(req)

    async def pull(self, req: Any, ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.pull(req, ctx.time_remaining())

    async def pull_batch(self, req: Any, ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.pull_batch(req, ctx.time_remaining())

    def watch_completions(self, req: Any, _ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        return self.core.watch(req)

    async def release(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.release(req)

    async def abort(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.abort(req)

    async def drain(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.drain(float(req.timeout_seconds) or None)

    async def get_status(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.status(req)


class _PeerApi:
    """Peer service methods."""

    def __init__(self, core: SidecarCore) -> None:
        self.core = core

    async def handshake(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_handshake(req)

    async def get_published(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_get_published(req)

    async def get_published_batch(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_get_published_batch(req)

    async def notify(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_notify(req)

    async def notify_batch(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_notify_batch(req)

    async def abort(self, req: Any, _ctx: grpc.aio.ServicerContext) -> Any:
        return await self.core.peer_abort(req)


class Sidecar:
    """One sidecar: start it, use its addresses, drain and stop it."""

    def __init__(self, settings: Settings, *, data_plane: DataPlane | None = None) -> None:
        self.settings = settings
        self._dp = data_plane
        self.core: SidecarCore | None = None
        self.metrics: SidecarMetrics | None = None
        self.health = health.aio.HealthServicer()
        self._peer_server: grpc.aio.Server | None = None
        self._local_server: grpc.aio.Server | None = None
        self.peer_port = 0
        self.local_port = 0
        self.metrics_port = 0
        self._stopped = asyncio.Event()
        self._socket_path: Path | None = None
        self.fd_box: FdBox | None = None

    # ------------------------------------------------------------------ addresses
    @property
    def peer_address(self) -> str:
        """What peers dial (advertised host, bound port)."""
        return self.settings.advertise_address(self.peer_port)

    @property
    def local_target(self) -> str:
        """gRPC target of the local API (Unix socket when enabled, else TCP)."""
        if self.settings.local_socket:
            return f"unix://{Path(self.settings.local_socket).resolve()}"
        host, _ = parse_address(self.settings.local_listen or "", setting="local_listen")
        return f"{host}:{self.local_port}"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind every listener, bring the data plane up and start serving."""
        s = self.settings
        opts = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Reconnect to a restarted peer within a second, not after gRPC's default backoff.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        token = s.token()
        interceptors = [TokenInterceptor(token)] if token else []
        self.metrics = SidecarMetrics(s.backend)
        if self._dp is None:
            # A library's own log handler (NIXL's prints plain text on stdout) gives way to ours
            # (JSON on stderr) before its agent logs a first line.
            with contextlib.suppress(KvxferError):
                for name in transport_class(s.backend).library_loggers():
                    adopt_logger(name)
            agent = f"{s.engine_id}-{os.getpid()}-{id(self):x}"
            self._dp = create_data_plane(
                s.backend, agent,
                options={"nixl_backends": s.nixl_backends, "mooncake_protocol": s.mooncake_protocol,
                         "mooncake_device": s.mooncake_device, "data_port": s.data_port,
                         "listen_host": s.advertise_address(0).rsplit(":", 1)[0].strip("[]")},
            )  # fmt: skip
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)

        peer = grpc.aio.server(interceptors=interceptors, options=opts)
        self._peer_server = peer
        self.peer_port = self._bind(peer, s.peer_listen, "peer_listen", secure=True)
        if s.local_socket:
            # Descriptors of a worker's memory (CPU workers whose cache no other process can name).
            self.fd_box = FdBox(fd_socket_path(_prepare_socket(Path(s.local_socket))), token=token, mode=SOCKET_MODE)
        self.core = SidecarCore(
            s, self._dp, self.metrics, peer_address=self.peer_address, channel_options=opts,
            channel_credentials=self._channel_credentials(), on_serving=self._set_serving,
            fd_lookup=self.fd_box.fds if self.fd_box is not None else None,
        )  # fmt: skip
        peer_limits = {"Handshake": 30.0, "GetPublished": 30.0, "GetPublishedBatch": 30.0, "Notify": 30.0,
                       "NotifyBatch": 30.0, "Abort": 30.0}  # fmt: skip
        peer.add_generic_rpc_handlers((service_handler(PEER_SERVICE, _PeerApi(self.core), limits=peer_limits),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, peer)
        reflection.enable_server_reflection(
            (PEER_SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), peer
        )

        local = grpc.aio.server(interceptors=interceptors, options=opts)
        self._local_server = local
        local_limits: dict[str, float | None] = {
            # A pull runs under min(timeout_seconds, --transfer-timeout-seconds, the caller's deadline)
            # inside the core; a second timer per call would only cost time on the hot path.
            "Pull": None,
            "PullBatch": None,
            "Drain": s.drain_seconds + 30.0,
            "RegisterCaches": 120.0,
        }
        local.add_generic_rpc_handlers((service_handler(LOCAL_SERVICE, _LocalApi(self.core), limits=local_limits),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, local)
        reflection.enable_server_reflection(
            (LOCAL_SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), local
        )
        if s.local_socket:
            self._socket_path = _prepare_socket(Path(s.local_socket))
            if local.add_insecure_port(f"unix://{self._socket_path}") == 0:
                raise ConfigError(f"--local-socket: cannot listen on {self._socket_path}", field="local_socket")
        if s.local_listen:
            self.local_port = self._bind(local, s.local_listen, "local_listen", secure=False)

        await peer.start()
        await local.start()
        if self.fd_box is not None:
            await self.fd_box.start()
        if self._socket_path is not None:
            # The worker runs as another user in another container: the pod's shared group
            # (fsGroup) may connect, nobody else. The token, when set, still applies.
            os.chmod(self._socket_path, SOCKET_MODE)
        if s.metrics_listen:
            host, port = parse_address(s.metrics_listen, setting="metrics_listen")
            try:
                self.metrics_port = self.metrics.serve(host, port)
            except OSError as exc:
                raise ConfigError(f"--metrics-listen: cannot listen on {s.metrics_listen}: {exc}",
                                  field="metrics_listen") from None  # fmt: skip
        log.info(
            "sidecar started",
            extra={"engine_id": s.engine_id, "peer_address": self.peer_address, "local": self.local_target,
                   "metrics_port": self.metrics_port, "backend": s.backend, "role": s.role,
                   "version": __version__, "protocol": PROTOCOL_VERSION, "auth": bool(token),
                   "tls": s.tls_enabled, "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0]},
        )  # fmt: skip

    def _bind(self, server: grpc.aio.Server, address: str, setting: str, *, secure: bool) -> int:
        parse_address(address, setting=setting)
        creds = self._server_credentials() if secure else None
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"--{setting.replace('_', '-')}: cannot listen on {address}: {exc}",
                              field=setting) from None  # fmt: skip
        if port == 0:
            raise ConfigError(
                f"--{setting.replace('_', '-')}: cannot listen on {address} (in use or not a local address)",
                field=setting,
            )
        return int(port)

    def _server_credentials(self) -> grpc.ServerCredentials | None:
        s = self.settings
        if not s.tls_enabled:
            return None
        assert s.tls_cert is not None
        assert s.tls_key is not None
        ca = s.tls_ca.read_bytes() if s.tls_ca else None
        return grpc.ssl_server_credentials(
            [(s.tls_key.read_bytes(), s.tls_cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def _channel_credentials(self) -> grpc.ChannelCredentials | None:
        s = self.settings
        if not s.tls_enabled:
            return None
        assert s.tls_cert is not None
        assert s.tls_key is not None
        return grpc.ssl_channel_credentials(
            root_certificates=s.tls_ca.read_bytes() if s.tls_ca else None,
            private_key=s.tls_key.read_bytes(),
            certificate_chain=s.tls_cert.read_bytes(),
        )

    def _set_serving(self, serving: bool) -> None:
        async def apply() -> None:
            for svc in HEALTH_SERVICES:
                await self.health.set(svc, SERVING if serving else NOT_SERVING)

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(apply())

    async def drain(self, budget: float | None = None) -> Any:
        """Graceful drain (what SIGTERM starts); ``budget`` defaults to --drain-seconds."""
        assert self.core is not None
        return await self.core.drain(budget)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving and release everything (no drain: call :meth:`drain` first for that)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.core is not None:
            self.core.draining = True
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, NOT_SERVING)
        if self.core is not None:
            self.core.hub.close()
        servers = [srv for srv in (self._local_server, self._peer_server) if srv is not None]
        await asyncio.gather(*(srv.stop(grace) for srv in servers))
        if self.core is not None:
            await self.core.close()
        if self.fd_box is not None:
            await self.fd_box.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()

    async def wait_stopped(self) -> None:
        """Until :meth:`stop` has run."""
        await self._stopped.wait()


#: Mode of the local API's Unix socket: owner and group read/write.
SOCKET_MODE = 0o660


def _prepare_socket(path: Path) -> Path:
    """Create the socket's directory and remove a stale socket (refuse a live one)."""
    path = path.resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--local-socket: cannot create directory {path.parent}: {exc}", field="local_socket"
        ) from None
    if path.exists():
        if not stat.S_ISSOCK(path.stat().st_mode):
            raise ConfigError(f"--local-socket: {path} exists and is not a socket", field="local_socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens
        else:
            raise ConfigError(f"--local-socket: another process is serving on {path}", field="local_socket")
        finally:
            probe.close()
    return path


def serve_main(settings: Settings, *, hard_exit: bool = True) -> int:
    """``kvxfer serve``: run until SIGTERM/SIGINT or a Drain call, drain, exit 0 (2: cannot start).

    With ``hard_exit`` the process ends with ``os._exit`` once everything is shut down and flushed:
    native data-plane libraries can crash in their exit-time destructors (here: two copies of
    libnl, one bundled with NIXL's UCX and one pulled in by the system libibverbs), which would
    turn a clean drain into exit code 139 for Kubernetes.
    """
    configure_logging(settings.log_level, settings.log_format)
    log.info("settings", extra={"settings": settings.redacted()})
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency; fall back only so a broken install still serves
        runner = asyncio.run
    try:
        code = int(runner(_serve(settings)))
    except KvxferError as exc:  # a port in use, a data plane that will not start: one line, exit 2
        log.error("cannot start", extra={"error": exc.message, "setting": exc.field})
        code = 2
    except Exception as exc:
        log.exception("sidecar failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        code = 1
    if hard_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def _serve(settings: Settings) -> int:
    sidecar = Sidecar(settings)
    try:
        await sidecar.start()
    except BaseException:
        await sidecar.stop(0)
        raise
    assert sidecar.core is not None
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)

    async def drained() -> None:
        # A Drain RPC (kvxfer drain) ends the process too, once it has drained.
        assert sidecar.core is not None
        await sidecar.core.drain_done.wait()
        await asyncio.sleep(0.2)  # let the Drain call's answer go out

    waiter = asyncio.create_task(stop_requested.wait())
    drain_waiter = asyncio.create_task(drained())
    await asyncio.wait([waiter, drain_waiter], return_when=asyncio.FIRST_COMPLETED)
    if waiter.done():
        log.info("signal received; draining")
        await sidecar.drain()
    waiter.cancel()
    drain_waiter.cancel()
    await sidecar.stop(grace=1.0)
    log.info("sidecar stopped")
    return 0
