"""Prometheus metrics of one sidecar, on a registry the sidecar owns, and the /metrics server.

The names, types and labels are fixed by docs/sidecar-contract.md (the dashboard and alerts are
written against them). A private :class:`CollectorRegistry` instead of prometheus_client's global
one lets several sidecars live in one process (tests, library mode) without clashing.

prometheus_client's own ``start_http_server`` cannot ask for credentials, so /metrics is its WSGI
app behind an optional bearer-token check, served by wsgiref in a daemon thread.
"""

from __future__ import annotations

import bisect
import gc
import hmac
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import HistogramMetricFamily, Metric

from kvxfer import PROTOCOL_VERSION, __version__

__all__ = ["Direction", "GcPauses", "Outcome", "SidecarMetrics", "bearer_auth"]

Direction = Literal["read", "write", "push"]
Outcome = Literal["ok", "failed", "aborted", "timeout"]
#: kvxfer_prepared_pulls_total: planned by a Prepare; a Pull read on the plan; a Pull found it stale
#: (another pull, or a publisher or this worker registered again since) and planned anew.
PREPARED_OUTCOMES = ("prepared", "used", "replanned")
#: kvxfer_pulls_by_path_total: what a pull's READs waited for (kvxfer.server.pull_steps): a grant that
#: had come before it, the answer of a Hold that was out, nothing (the lookup confirms as they run),
#: the lookup's answer; or the publishers WRITE.
PULL_PATHS = ("grant", "hold_answer", "ahead", "lookup", "push")

# Transfer durations on loopback are sub-millisecond for small pulls and seconds for long
# prompts over TCP; the buckets cover both ends in roughly 2.5x steps.
_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DESCRIPTOR_BUCKETS = tuple(float(2**i) for i in range(0, 19, 2))  # 1 .. 262144


class SidecarMetrics:
    """Every metric of the contract, registered on ``self.registry``."""

    def __init__(self, backend: str, registry: CollectorRegistry | None = None) -> None:
        # The contract lists no *_created series; they only double the exposition's size.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.backend = backend
        r = self.registry
        self.build_info = Gauge(
            "kvxfer_build_info", "kvxfer build and protocol version", ["version", "protocol"], registry=r
        )
        self.build_info.labels(version=__version__, protocol=str(PROTOCOL_VERSION)).set(1)
        self.transfer_bytes = Counter(
            "kvxfer_transfer_bytes_total", "Bytes moved by the data plane", ["direction", "backend"], registry=r
        )
        self.transfers = Counter("kvxfer_transfers_total", "Transfers by outcome", ["direction", "outcome"], registry=r)
        self.failures = Counter("kvxfer_transfer_failures_total", "Failed transfers by reason", ["reason"], registry=r)
        self.duration = Histogram(
            "kvxfer_transfer_duration_seconds", "Transfer duration (request to completion)", ["direction"],
            buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.descriptors = Histogram(
            "kvxfer_transfer_descriptors", "Descriptors per transfer", ["direction"],
            buckets=_DESCRIPTOR_BUCKETS, registry=r,
        )  # fmt: skip
        self._ok: dict[str, tuple[Any, Any, Any, Any]] = {}  # a direction's series of a successful transfer
        self.in_flight = Gauge("kvxfer_transfers_in_flight", "Transfers in flight", registry=r)
        self.leases_active = Gauge("kvxfer_leases_active", "Published requests held under a lease", registry=r)
        self.lease_expirations = Counter("kvxfer_lease_expirations_total", "Leases that expired", registry=r)
        self.handshakes = Counter("kvxfer_handshakes_total", "Peer handshakes by outcome", ["outcome"], registry=r)
        self.prepared_pulls = Counter(
            "kvxfer_prepared_pulls_total", "Pulls planned ahead by Prepare, and what their Pulls made of the plan",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.pull_paths = Counter(
            "kvxfer_pulls_by_path_total", "Pulls by what their READs waited for: a grant, a Hold's answer, nothing "
            "(read ahead of the lookup), the lookup; or push", ["path"], registry=r,
        )  # fmt: skip
        self.peers = Gauge("kvxfer_peers", "Peers with a live handshake", registry=r)
        self.unfenced = Counter(
            "kvxfer_data_plane_unfenced_total", "Failed or cancelled data-plane transfers reported while their "
            "operation was still in flight after the fence budget (their bytes may still land)", ["op"], registry=r,
        )  # fmt: skip
        self.unsettled = Gauge(
            "kvxfer_unsettled_pulls", "Failed pulls whose READs may still land in their blocks (reason "
            "DATA_PLANE_UNFENCED), not yet seen to end: their workers keep the blocks", registry=r,
        )  # fmt: skip
        self.registered_bytes = Gauge("kvxfer_registered_bytes", "Bytes of KV memory registered", registry=r)
        #: kvxfer_gc_pause_seconds; the sidecar starts and stops its timing (the collector is the process's).
        self.gc_pauses = GcPauses()
        r.register(self.gc_pauses)
        # Pre-create the label sets a dashboard plots, so they read 0 instead of being absent.
        for d in ("read", "write", "push"):
            self.transfer_bytes.labels(direction=d, backend=backend)
            for o in ("ok", "failed", "aborted", "timeout"):
                self.transfers.labels(direction=d, outcome=o)
        for o in ("ok", "refused", "failed"):
            self.handshakes.labels(outcome=o)
        for op in ("read", "write"):
            self.unfenced.labels(op=op)
        for o in PREPARED_OUTCOMES:
            self.prepared_pulls.labels(outcome=o)
        for path in PULL_PATHS:
            self.pull_paths.labels(path=path)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def transfer_done(
        self, direction: Direction, outcome: Outcome, *, nbytes: int, descriptors: int, seconds: float,
        reason: str | None = None,
    ) -> None:  # fmt: skip
        """Record one finished transfer."""
        if outcome == "ok":
            # Every pull lands here: the label lookups are done once per direction, not per pull.
            kids = self._ok.get(direction)
            if kids is None:
                kids = self._ok[direction] = (
                    self.transfers.labels(direction=direction, outcome="ok"),
                    self.transfer_bytes.labels(direction=direction, backend=self.backend),
                    self.duration.labels(direction=direction),
                    self.descriptors.labels(direction=direction),
                )
            done, moved, took, descs = kids
            done.inc()
            moved.inc(nbytes)
            took.observe(seconds)
            descs.observe(descriptors)
        else:
            self.transfers.labels(direction=direction, outcome=outcome).inc()
            self.failures.labels(reason=reason or outcome).inc()

    def exposition(self) -> bytes:
        """The text exposition format (what /metrics serves)."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, *, token: str | None = None) -> int:
        """Serve /metrics on ``host:port`` in a daemon thread; returns the bound port.

        With ``token`` every request must carry ``Authorization: Bearer <token>`` (401 otherwise).
        Raises OSError when the address cannot be bound.
        """
        app = make_wsgi_app(self.registry)
        if token is not None:
            app = bearer_auth(app, token)
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        server: WSGIServer = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="kvxfer-metrics", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        return int(server.server_port)

    def stop(self) -> None:
        """Stop the /metrics server, if any."""
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# ---------------------------------------------------------------------------- /metrics server
_WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow client cannot hold /metrics for the others."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: the sidecar's logs are JSON lines."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def bearer_auth(app: _WsgiApp, token: str) -> _WsgiApp:
    """``app`` behind ``Authorization: Bearer <token>``: 401 with ``WWW-Authenticate`` otherwise.

    The comparison takes the same time whatever the guess, and the token is never echoed.
    """
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        got = str(environ.get("HTTP_AUTHORIZATION", "")).encode("latin-1", "replace")
        scheme, _, _ = got.partition(b" ")
        # The scheme is case-insensitive (RFC 9110); the credentials are not.
        got = b"Bearer" + got[len(scheme) :] if scheme.lower() == b"bearer" else got
        if hmac.compare_digest(got, expected):
            return app(environ, start_response)
        body = b"401 Unauthorized: /metrics needs the header 'Authorization: Bearer <token>' (--metrics-auth token)\n"
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
             ("WWW-Authenticate", 'Bearer realm="kvxfer-metrics"')],
        )  # fmt: skip
        return [body]

    return guarded


GC_PAUSE_NAME = "kvxfer_gc_pause_seconds"
GC_PAUSE_HELP = "Pauses of the sidecar process's Python garbage collector, by generation"
#: Upper bounds (seconds) of kvxfer_gc_pause_seconds' buckets: 0.1 ms (a young generation) to 0.25 s.
PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
GENERATIONS = (0, 1, 2)


class GcPauses:
    """Times each collection while started, and is the collector of ``kvxfer_gc_pause_seconds{generation}``.

    Register it on a metrics registry. The callback only adds to plain lists: it runs inside the
    collection, in whatever thread allocated, and must not take a lock that thread may hold (a
    prometheus_client metric's).
    """

    LABELS = ("generation",)

    def __init__(self) -> None:
        self._began = 0.0
        self._counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in GENERATIONS]  # per bucket, +Inf last
        self._sums = [0.0 for _ in GENERATIONS]

    def start(self) -> None:
        """Time collections from now on."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        """Stop timing them."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        gen = min(int(info["generation"]), len(GENERATIONS) - 1)
        self._counts[gen][bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1
        self._sums[gen] += seconds

    def describe(self) -> Iterator[Metric]:
        """The metric's name and type (without reading the counts)."""
        yield HistogramMetricFamily(GC_PAUSE_NAME, GC_PAUSE_HELP, labels=list(GcPauses.LABELS))

    def collect(self) -> Iterator[Metric]:
        """The histogram as it stands (prometheus_client calls this at every scrape)."""
        family = HistogramMetricFamily(GC_PAUSE_NAME, GC_PAUSE_HELP, labels=list(GcPauses.LABELS))
        for gen in GENERATIONS:
            counts, running = list(self._counts[gen]), 0
            buckets = []
            for le, n in zip((*(repr(b) for b in PAUSE_BUCKETS), "+Inf"), counts, strict=True):
                running += n
                buckets.append((le, float(running)))
            family.add_metric([str(gen)], buckets, self._sums[gen])
        yield family
