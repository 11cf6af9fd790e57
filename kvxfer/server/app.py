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
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer import PROTOCOL_VERSION, __version__
from kvxfer.addresses import parse_address
from kvxfer.config import ConfigError, Settings
from kvxfer.errors import FailedPreconditionError, KvxferError, Reason
from kvxfer.fdpass import FdBox, fd_socket_path
from kvxfer.logs import adopt_logger, configure_logging, get_logger
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.busy_poll import BusyPoll, rate_under_limit
from kvxfer.server.core import SidecarCore
from kvxfer.server.cpu_room import cpu_limit_cores, host_cores
from kvxfer.server.fast_api import FastApi
from kvxfer.server.heap import freeze_startup_heap
from kvxfer.server.listeners import (
    SOCKET_MODE,
    bind_tcp,
    channel_credentials,
    listen_unix,
    listeners_without_credentials,
    peer_channel_options,
    prepare_socket,
    server_credentials,
)
from kvxfer.server.peer_frames import PeerFramesServer
from kvxfer.server.rpc import TokenInterceptor, service_handler
from kvxfer.server.servicers import LocalServicer, PeerServicer
from kvxfer.transport import Transport, create_transport, transport_class
from kvxfer.wire import local_pb2, peer_pb2
from kvxfer.wire.frames import fast_socket_path

__all__ = ["HEALTH_SERVICES", "Sidecar", "serve_main"]

log = get_logger("kvxfer.server")
LOCAL_SERVICE = local_pb2.DESCRIPTOR.services_by_name["Local"]
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"]
HEALTH_SERVICES = ("", PEER_SERVICE.full_name, LOCAL_SERVICE.full_name)
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Context = grpc.aio.ServicerContext[Any, Any]


class Sidecar:
    """One sidecar: start it, use its addresses, drain and stop it."""

    def __init__(self, settings: Settings, *, data_plane: Transport | None = None) -> None:
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
        self.fast_api: FastApi | None = None
        self.peer_frames: PeerFramesServer | None = None
        self.busy_poll: BusyPoll | None = None

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
        data_plane = self._dp if self._dp is not None else self._start_data_plane()
        self._dp = data_plane
        data_plane.on_unfenced = self._unfenced
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)

        peer = self._peer_server = grpc.aio.server(interceptors=interceptors, options=opts)
        self.peer_port = bind_tcp(peer, s.peer_listen, "peer_listen", server_credentials(s))
        if s.local_socket:
            # Descriptors of a worker's memory (CPU workers whose cache no other process can name).
            self.fd_box = FdBox(fd_socket_path(prepare_socket(Path(s.local_socket))), token=token, mode=SOCKET_MODE,
                                on_gone=self._lease_closed)  # fmt: skip
        self.core = SidecarCore(
            s, data_plane, self.metrics, peer_address=self.peer_address,
            channel_options=[*opts, *peer_channel_options(s)], channel_credentials=channel_credentials(s),
            on_serving=self._set_serving,
            fd_lookup=self.fd_box.fds if self.fd_box is not None else None,
        )  # fmt: skip
        # A pull's lookups, notices and holds never wait on anything (their Publisher methods are plain
        # functions, awaiting nothing; keep them so): a timer per call (the default limit) would only
        # cost the publisher CPU on every pull.
        peer_limits = dict.fromkeys(("GetPublished", "GetPublishedBatch", "Notify", "NotifyBatch", "Hold"))
        peer_api = PeerServicer(self.core, client_certs=s.tls_ca is not None)
        # Polls while the hot calls come fast (--busy-poll-above-rate; by default not under a CPU limit
        # below 1.5 cores nor on fewer than 4 CPUs); a window after every call only with
        # --busy-poll-seconds: polling costs a core while it lasts.
        asked = "busy_poll_above_rate" in s.model_fields_set
        rate, why = rate_under_limit(s.busy_poll_above_rate, cpu_limit_cores(), host_cores(), asked=asked)
        if why:
            if asked:
                log.warning("busy polling above a rate without a core to spare", extra={"why": why, "rate": rate})
            else:
                log.info("busy polling above a rate is off", extra={"why": why, "hint": "--busy-poll-above-rate"})
        busy = self.busy_poll = BusyPoll(asyncio.get_running_loop(), s.busy_poll_seconds, rate)
        self._serve(peer, PEER_SERVICE, peer_api, peer_limits)
        if s.peer_frames:
            # The hot peer calls as frames beside it: same servicer, limits, TLS and token.
            self.peer_frames = PeerFramesServer(s, peer_api, limits=peer_limits, token=token,
                                                instance_id=self.core.instance_id, on_frame=busy.poke)  # fmt: skip
            self.core.registry.frames_address = self.peer_frames.address
        local = self._local_server = grpc.aio.server(interceptors=interceptors, options=opts)
        # A pull runs under min(timeout_seconds, --transfer-timeout-seconds, the caller's deadline)
        # inside the core; a second timer per call would only cost time on the hot path.
        # Expect and Publish await nothing (as the peer calls above): a timer could never fire.
        local_limits = {"Pull": None, "PullBatch": None, "Expect": None, "Publish": None,
                        "Drain": s.drain_seconds + 30.0, "RegisterCaches": 120.0}  # fmt: skip
        local_api = LocalServicer(self.core)
        self._serve(local, LOCAL_SERVICE, local_api, local_limits)
        self._bind_local(local)
        if self._socket_path is not None and s.fast_socket:
            # The hot calls as frames beside the local socket: same servicer, limits, mode and token.
            self.fast_api = FastApi(fast_socket_path(self._socket_path), local_api,
                                    limits=local_limits, token=token, mode=SOCKET_MODE,
                                    max_message_bytes=s.max_message_bytes, on_frame=busy.poke)  # fmt: skip

        await peer.start()
        if self.peer_frames is not None:
            await self.peer_frames.start()
        await local.start()
        if self.fd_box is not None:
            await self.fd_box.start()
        if self.fast_api is not None:
            try:
                await self.fast_api.start()
            except OSError as exc:
                # E.g. a socket path one byte too long for ".fast": workers use gRPC for every call.
                log.warning("fast socket not served; workers use gRPC", extra={"socket": str(self.fast_api.path),
                                                                                "error": str(exc)})  # fmt: skip
                self.fast_api = None
        self._serve_metrics(self.metrics)
        self.metrics.gc_pauses.start()  # last: a start that fails leaves no callback in the collector
        for setting, address in listeners_without_credentials(s):
            log.warning("listening without credentials beyond loopback",
                        extra={"setting": setting, "address": address, "insecure": s.insecure})  # fmt: skip
        log.info(
            "sidecar started",
            extra={"engine_id": s.engine_id, "peer_address": self.peer_address, "local": self.local_target,
                   "peer_frames": self.peer_frames.address if self.peer_frames is not None else None,
                   "metrics_port": self.metrics_port, "metrics_auth": s.metrics_token is not None,
                   "backend": s.backend, "role": s.role,
                   "version": __version__, "protocol": PROTOCOL_VERSION, "auth": bool(token),
                   "tls": s.tls_enabled, "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0]},
        )  # fmt: skip

    def _unfenced(self, op: str, peer: str) -> None:
        """A transfer reported failed while its operation was still in flight (the transport logged it)."""
        if self.metrics is not None:
            self.metrics.unfenced.labels(op=op.lower()).inc()
        if self.core is not None:  # watched until it ends, whether or not anyone asks
            self.core.puller.unsettled.watch()

    def _start_data_plane(self) -> Transport:
        s = self.settings
        # A library's own log handler (NIXL's prints plain text on stdout) gives way to ours
        # (JSON on stderr) before its agent logs a first line.
        with contextlib.suppress(KvxferError):
            for name in transport_class(s.backend).library_loggers():
                adopt_logger(name)
        agent = f"{s.engine_id}-{os.getpid()}-{id(self):x}"
        try:
            return create_transport(s.backend, agent, s.transport_config())
        except KvxferError as exc:
            raise FailedPreconditionError(
                f"backend: the {s.backend} data plane did not start: {exc.message}", field="backend",
                reason=Reason.DATA_PLANE_START,
            ) from None  # fmt: skip

    def _serve(self, server: grpc.aio.Server, service: Any, api: object, limits: Mapping[str, float | None]) -> None:
        """``api``'s methods as ``service`` on ``server``, with health checks and reflection beside them."""
        server.add_generic_rpc_handlers((service_handler(service, api, limits=limits),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((service.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    def _bind_local(self, local: grpc.aio.Server) -> None:
        s = self.settings
        if s.local_socket:
            path = prepare_socket(Path(s.local_socket))
            listen_unix(local, path)
            self._socket_path = path
        if s.local_listen:
            self.local_port = bind_tcp(local, s.local_listen, "local_listen", None)

    def _serve_metrics(self, metrics: SidecarMetrics) -> None:
        address = self.settings.metrics_listen
        if not address:
            return
        host, port = parse_address(address, setting="metrics_listen")
        try:
            self.metrics_port = metrics.serve(host, port, token=self.settings.metrics_token)
        except OSError as exc:
            raise ConfigError(f"--metrics-listen: cannot listen on {address}: {exc}", field="metrics_listen") from None

    def _lease_closed(self, handle: str) -> None:
        if self.core is not None and not self._stopped.is_set():  # on shutdown every lease closes
            self.core.lease_closed(handle)

    def _set_serving(self, serving: bool) -> None:
        async def apply() -> None:
            for svc in HEALTH_SERVICES:
                await self.health.set(svc, SERVING if serving else NOT_SERVING)

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(apply())

    async def drain(self, budget: float | None = None) -> local_pb2.DrainResponse:
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
        fast = [api.close(grace) for api in (self.fast_api, self.peer_frames) if api is not None]
        await asyncio.gather(*(srv.stop(grace) for srv in servers), *fast)
        if self.core is not None:
            await self.core.close()
        if self.fd_box is not None:
            await self.fd_box.close()
        if self.metrics is not None:
            self.metrics.gc_pauses.stop()
            self.metrics.stop()
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()

    async def wait_stopped(self) -> None:
        """Until :meth:`stop` has run."""
        await self._stopped.wait()


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
    frozen = freeze_startup_heap()
    log.debug("start-up heap frozen", extra={"objects": frozen})
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
