"""Clients of the sidecar's local API, for workers: :class:`AsyncClient` and its blocking facade :class:`Client`.

Every call carries a deadline (``deadline`` per call, else the client's ``timeout``, default 30 s)
and the bearer token when one is set; failures raise :class:`KvxferRpcError` with the status code,
the sidecar's message and its machine-readable ``reason`` and ``field``.

The hot calls (``pull``, ``pull_batch``, ``publish``) go to a sidecar on a Unix socket as frames
on its fast socket (``<socket>.fast``, :mod:`kvxfer.wire.frames`) when it serves one: the same
messages, deadlines, token and errors, ~0.5 ms less per call than gRPC. Every other call, and
every call when the fast socket cannot be reached, goes over gRPC (``fast=False``: always gRPC).

:class:`Client` runs one :class:`AsyncClient` on a private event-loop thread: its methods block,
:meth:`Client.submit` starts any coroutine of :attr:`Client.aio` from any thread and returns a
:class:`concurrent.futures.Future` (what vLLM's worker half uses to keep pulls off its step).
:meth:`Client.pull` and :meth:`Client.publish` go from the calling thread itself, over that
thread's own fast-socket connection (:mod:`kvxfer.client.fast`), without the loop thread.

Typical prefill worker::

    buf = SharedKVBuffer.create(layout)
    with Client("unix:///run/kvxfer/kvxfer.sock") as c:
        c.register_caches({"attention": (layout, buf.ref())}, rank=RankInfo(0, 1))
        c.publish("req-1", {"attention": block_ids})

Typical decode worker::

    c.pull("req-1", ["prefill-0:50051"], {"attention": local_ids}, wait=True)
"""

from kvxfer.client.aio import AsyncClient
from kvxfer.client.blocking import Client
from kvxfer.client.types import (
    CacheGroupSpec,
    CompletionEvent,
    KvxferRpcError,
    PullItem,
    PullResult,
    TokenSpan,
    normalize_target,
)

__all__ = [
    "AsyncClient",
    "CacheGroupSpec",
    "Client",
    "CompletionEvent",
    "KvxferRpcError",
    "PullItem",
    "PullResult",
    "TokenSpan",
    "normalize_target",
]
