"""Clients of the sidecar's local API, for workers: :class:`AsyncClient` (grpc.aio) and :class:`Client`.

Every call carries a deadline (``deadline`` per call, else the client's ``timeout``, default 30 s)
and the bearer token when one is set; failures raise :class:`KvxferRpcError` with the status code
and the sidecar's message.

Typical prefill worker::

    buf = SharedKVBuffer.create(layout)
    with Client("unix:///run/kvxfer/kvxfer.sock") as c:
        c.register_caches({"attention": (layout, buf.ref())}, rank=RankInfo(0, 1))
        c.publish("req-1", {"attention": block_ids})

Typical decode worker::

    c.pull("req-1", ["prefill-0:50051"], {"attention": local_ids}, wait=True)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer._proto.kvxfer.v1 import common_pb2, local_pb2, local_pb2_grpc
from kvxfer.errors import KvxferError
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import MemoryRef
from kvxfer.topology import RankInfo

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

BlockMap = Mapping[str, Sequence[int] | npt.NDArray[np.integer]]
GroupsArg = Sequence["CacheGroupSpec"] | Mapping[str, tuple[KVCacheLayout, MemoryRef]]


class KvxferRpcError(KvxferError):
    """A sidecar call failed: ``code`` is the gRPC status, ``message`` the sidecar's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        super().__init__(f"{method}: {code.name}: {message}" if method else f"{code.name}: {message}")
        self.code = code
        self.details = message
        self.method = method


@dataclass(frozen=True)
class CacheGroupSpec:
    """One cache group to register: its name, layout and where its memory is."""

    name: str
    layout: KVCacheLayout
    memory: MemoryRef


@dataclass(frozen=True)
class PullResult:
    """The answer to a pull."""

    transfer_id: str
    request_id: str
    done: bool
    bytes: int = 0
    descriptors: int = 0
    duration_seconds: float = 0.0
    data_seconds: float = 0.0
    remote_ranks: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    fetch_seconds: float = 0.0  # handshakes + GetPublished round trips (part of duration_seconds)


@dataclass(frozen=True)
class TokenSpan:
    """Which tokens of a group's block lists a pull moves (see ``BlockList`` in local.proto).

    Tokens ``[local_skip, local_skip + num_tokens)`` of the local list receive tokens
    ``[remote_skip, remote_skip + num_tokens)`` of the remote list; the lists may then differ in length.
    """

    num_tokens: int
    local_skip: int = 0
    remote_skip: int = 0


@dataclass(frozen=True)
class PullItem:
    """One pull of a :meth:`AsyncClient.pull_batch`: the arguments :meth:`AsyncClient.pull` takes."""

    request_id: str
    remote_addresses: Sequence[str]
    local_blocks: BlockMap
    remote_blocks: BlockMap | None = None
    remote_engine_id: str = ""
    wait: bool = True
    deadline: float | None = None
    spans: Mapping[str, TokenSpan] | None = None


@dataclass(frozen=True)
class CompletionEvent:
    """One event of the completion stream."""

    sequence: int
    kind: str  # PULLED, PULL_FAILED, RELEASED, EXPIRED, ABORTED
    request_id: str
    transfer_id: str
    code: grpc.StatusCode
    message: str
    peer: str
    bytes: int = 0
    descriptors: int = 0
    duration_seconds: float = 0.0
    unix_ms: int = 0
    raw: Any = field(default=None, repr=False, compare=False)


def normalize_target(target: str) -> str:
    """``/path/sock`` or ``unix:/path`` -> ``unix:///path``; ``host:port`` unchanged."""
    if target.startswith("unix://"):
        return target
    if target.startswith("unix:"):
        return "unix://" + target[5:]
    if target.startswith("/"):
        return "unix://" + target
    return target


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def _groups_proto(groups: GroupsArg) -> list[Any]:
    from kvxfer.server.convert import layout_to_proto, memory_to_proto

    specs = [CacheGroupSpec(n, lay, mem) for n, (lay, mem) in groups.items()] if isinstance(groups, Mapping) else groups
    return [
        local_pb2.CacheGroup(name=g.name, layout=layout_to_proto(g.layout), memory=memory_to_proto(g.memory))
        for g in specs
    ]


def _blocks(blocks: BlockMap | None, spans: Mapping[str, TokenSpan] | None = None, *, local: bool = True) -> list[Any]:
    if not blocks:
        return []
    out = []
    for g, ids in blocks.items():
        bl = common_pb2.BlockList(group=g, block_ids=np.asarray(ids, dtype=np.int64).tolist())
        span = (spans or {}).get(g)
        if span is not None:
            bl.skip_tokens = span.local_skip if local else span.remote_skip
            if local:
                bl.num_tokens = span.num_tokens
        out.append(bl)
    return out


def _rank(rank: RankInfo) -> Any:
    return common_pb2.Rank(tp_rank=rank.tp_rank, tp_size=rank.tp_size, pp_rank=rank.pp_rank, pp_size=rank.pp_size)


def _pull_result(resp: Any) -> PullResult:
    st = resp.stats
    return PullResult(
        resp.transfer_id, resp.request_id, resp.done, st.bytes, st.descriptors, st.duration_seconds,
        st.data_seconds, tuple(st.remote_ranks), tuple(st.warnings), st.fetch_seconds,
    )  # fmt: skip


def _event(ev: Any) -> CompletionEvent:
    return CompletionEvent(
        ev.sequence, local_pb2.Completion.Kind.Name(ev.kind), ev.request_id, ev.transfer_id,
        _code(ev.code), ev.message, ev.peer, ev.stats.bytes, ev.stats.descriptors, ev.stats.duration_seconds,
        ev.unix_ms, ev,
    )  # fmt: skip


def _code(value: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN


def _pull_request(
    request_id: str, remote_addresses: Sequence[str], local_blocks: BlockMap, remote_blocks: BlockMap | None,
    remote_engine_id: str, wait: bool, deadline: float | None, spans: Mapping[str, TokenSpan] | None = None,
) -> Any:  # fmt: skip
    if spans and not remote_blocks:
        raise ValueError("spans: name remote_blocks too when moving part of a group's tokens")
    return local_pb2.PullRequest(
        request_id=request_id, remote_engine_id=remote_engine_id, remote_addresses=list(remote_addresses),
        remote_blocks=_blocks(remote_blocks, spans, local=False), local_blocks=_blocks(local_blocks, spans), wait=wait,
        timeout_seconds=deadline or 0.0,
    )  # fmt: skip


def _batch_request(items: Sequence[PullItem], timeout: float) -> tuple[Any, float]:
    """The PullBatch message and its call deadline (the longest pull's, plus a second)."""
    pulls = [
        _pull_request(
            i.request_id,
            i.remote_addresses,
            i.local_blocks,
            i.remote_blocks,
            i.remote_engine_id,
            i.wait,
            i.deadline,
            i.spans,
        )
        for i in items
    ]
    return local_pb2.PullBatchRequest(pulls=pulls), max((i.deadline or timeout for i in items), default=timeout) + 1.0


def _batch_results(resp: Any) -> list[PullResult | KvxferRpcError]:
    return [
        _pull_result(r.response) if r.code == 0 else KvxferRpcError(_code(r.code), r.message, "PullBatch")
        for r in resp.results
    ]


def _status_dict(resp: Any) -> dict[str, Any]:
    out = {}
    for f in resp.DESCRIPTOR.fields:
        value = getattr(resp, f.name)
        out[f.name] = value if isinstance(value, str | bytes | int | float | bool) else list(value)
    return out


class AsyncClient:
    """grpc.aio client of one sidecar's local API."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.target = normalize_target(target)
        self.timeout = timeout
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        opts = _options(max_message_bytes)
        self._channel = (
            grpc.aio.secure_channel(self.target, credentials, options=opts)
            if credentials is not None
            else grpc.aio.insecure_channel(self.target, options=opts)
        )
        self._stub = local_pb2_grpc.LocalStub(self._channel)

    async def _call(self, method: str, req: Any, deadline: float | None) -> Any:
        try:
            return await getattr(self._stub, method)(req, timeout=deadline or self.timeout, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise KvxferRpcError(exc.code(), exc.details() or "", method) from None

    async def register_caches(
        self, groups: GroupsArg, *, rank: RankInfo | None = None, worker_id: str = "", deadline: float | None = None
    ) -> dict[str, Any]:
        """Register cache groups; returns engine_id, instance_id, epoch, registered_bytes, backend, peer_address."""
        req = local_pb2.RegisterCachesRequest(
            worker_id=worker_id, rank=_rank(rank or RankInfo(0, 1)), groups=_groups_proto(groups)
        )
        return _status_dict(await self._call("RegisterCaches", req, deadline))

    async def publish(
        self, request_id: str, blocks: BlockMap, *, lease_seconds: float = 0.0, deadline: float | None = None
    ) -> int:
        """Publish a request's blocks; returns the lease's expiry (unix ms)."""
        req = local_pb2.PublishRequest(request_id=request_id, blocks=_blocks(blocks), lease_seconds=lease_seconds)
        return int((await self._call("Publish", req, deadline)).expires_unix_ms)

    async def pull(
        self, request_id: str, remote_addresses: Sequence[str], local_blocks: BlockMap, *,
        remote_blocks: BlockMap | None = None, remote_engine_id: str = "", wait: bool = True,
        deadline: float | None = None, spans: Mapping[str, TokenSpan] | None = None,
    ) -> PullResult:  # fmt: skip
        """Pull a published request into ``local_blocks``; with ``wait`` returns once the bytes are in place.

        ``spans`` moves part of a group's tokens (:class:`TokenSpan`); it needs ``remote_blocks``.
        """
        req = _pull_request(request_id, remote_addresses, local_blocks, remote_blocks, remote_engine_id, wait, deadline,
                            spans)  # fmt: skip
        call_timeout = (deadline or self.timeout) + 1.0
        return _pull_result(await self._call("Pull", req, call_timeout))

    async def pull_batch(self, items: Sequence[PullItem]) -> list[PullResult | KvxferRpcError]:
        """Several pulls in one call (e.g. all a worker starts in one step), one result or error each, in order.

        Each pull runs and fails on its own, as with :meth:`pull`; the call returns once all have
        answered. It raises only when the batch itself is refused (empty, over 1024 pulls, no sidecar).
        """
        req, call_timeout = _batch_request(items, self.timeout)
        return _batch_results(await self._call("PullBatch", req, call_timeout))

    async def watch_completions(self, *, replay: bool = False, after: int = 0) -> AsyncIterator[CompletionEvent]:
        """Completion events as they happen (no deadline: the stream lives as long as the caller wants)."""
        call = self._stub.WatchCompletions(
            local_pb2.WatchCompletionsRequest(replay=replay, after_sequence=after), metadata=self._md
        )
        try:
            async for ev in call:
                yield _event(ev)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise KvxferRpcError(exc.code(), exc.details() or "", "WatchCompletions") from None
        finally:
            call.cancel()

    async def release(self, request_id: str, *, deadline: float | None = None) -> bool:
        """Drop a publish; False if nothing was held under that id."""
        return bool((await self._call("Release", local_pb2.ReleaseRequest(request_id=request_id), deadline)).released)

    async def abort(self, request_id: str, reason: str = "", *, deadline: float | None = None) -> tuple[int, bool]:
        """Abort a request here and on its peers; returns (pulls aborted, publish aborted)."""
        resp = await self._call("Abort", local_pb2.AbortRequest(request_id=request_id, reason=reason), deadline)
        return int(resp.aborted_pulls), bool(resp.aborted_publish)

    async def drop_remote(
        self, request_id: str, remote_addresses: Sequence[str], reason: str = "", *, deadline: float | None = None
    ) -> int:
        """Tell the publishers of a request this side will not pull to free it now; returns how many held it.

        For a decode request that needs none of the published blocks (its own prefix cache covered
        them): without this, the prefill side holds them until the lease expires. It is an
        ``Abort`` of ``request_id``: a pull or publish of that id on this sidecar stops too.
        """
        req = local_pb2.AbortRequest(request_id=request_id, reason=reason, remote_addresses=list(remote_addresses))
        return int((await self._call("Abort", req, deadline)).remote_dropped)

    async def drain(self, timeout_seconds: float = 0.0, *, deadline: float | None = None) -> dict[str, Any]:
        """Start the graceful drain and wait for it."""
        resp = await self._call("Drain", local_pb2.DrainRequest(timeout_seconds=timeout_seconds), deadline)
        return _status_dict(resp)

    async def status(self, *, deadline: float | None = None) -> dict[str, Any]:
        """What the sidecar holds right now."""
        return _status_dict(await self._call("GetStatus", local_pb2.GetStatusRequest(), deadline))

    async def wait_ready(self, within: float = 30.0) -> None:
        """Until the sidecar answers GetStatus (it started)."""
        deadline = time.monotonic() + within
        while True:
            try:
                await self.status(deadline=min(2.0, max(deadline - time.monotonic(), 0.05)))
                return
            except KvxferRpcError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Client:
    """Blocking client of one sidecar's local API (same methods as :class:`AsyncClient`)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.target = normalize_target(target)
        self.timeout = timeout
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        opts = _options(max_message_bytes)
        self._channel = (
            grpc.secure_channel(self.target, credentials, options=opts)
            if credentials is not None
            else grpc.insecure_channel(self.target, options=opts)
        )
        self._stub = local_pb2_grpc.LocalStub(self._channel)

    def _call(self, method: str, req: Any, deadline: float | None) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=deadline or self.timeout, metadata=self._md)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise KvxferRpcError(code, details or "", method) from None

    def register_caches(
        self, groups: GroupsArg, *, rank: RankInfo | None = None, worker_id: str = "", deadline: float | None = None
    ) -> dict[str, Any]:
        """See :meth:`AsyncClient.register_caches`."""
        req = local_pb2.RegisterCachesRequest(
            worker_id=worker_id, rank=_rank(rank or RankInfo(0, 1)), groups=_groups_proto(groups)
        )
        return _status_dict(self._call("RegisterCaches", req, deadline))

    def publish(
        self, request_id: str, blocks: BlockMap, *, lease_seconds: float = 0.0, deadline: float | None = None
    ) -> int:
        """See :meth:`AsyncClient.publish`."""
        req = local_pb2.PublishRequest(request_id=request_id, blocks=_blocks(blocks), lease_seconds=lease_seconds)
        return int(self._call("Publish", req, deadline).expires_unix_ms)

    def pull(
        self, request_id: str, remote_addresses: Sequence[str], local_blocks: BlockMap, *,
        remote_blocks: BlockMap | None = None, remote_engine_id: str = "", wait: bool = True,
        deadline: float | None = None, spans: Mapping[str, TokenSpan] | None = None,
    ) -> PullResult:  # fmt: skip
        """See :meth:`AsyncClient.pull`."""
        req = _pull_request(request_id, remote_addresses, local_blocks, remote_blocks, remote_engine_id, wait, deadline,
                            spans)  # fmt: skip
        return _pull_result(self._call("Pull", req, (deadline or self.timeout) + 1.0))

    def pull_batch(self, items: Sequence[PullItem]) -> list[PullResult | KvxferRpcError]:
        """See :meth:`AsyncClient.pull_batch`."""
        req, call_timeout = _batch_request(items, self.timeout)
        return _batch_results(self._call("PullBatch", req, call_timeout))

    def watch_completions(self, *, replay: bool = False, after: int = 0) -> Iterator[CompletionEvent]:
        """See :meth:`AsyncClient.watch_completions`; cancel by closing the iterator."""
        call = self._stub.WatchCompletions(
            local_pb2.WatchCompletionsRequest(replay=replay, after_sequence=after), metadata=self._md
        )
        try:
            for ev in call:
                yield _event(ev)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise KvxferRpcError(exc.code(), exc.details() or "", "WatchCompletions") from None
        finally:
            call.cancel()

    def release(self, request_id: str, *, deadline: float | None = None) -> bool:
        """See :meth:`AsyncClient.release`."""
        return bool(self._call("Release", local_pb2.ReleaseRequest(request_id=request_id), deadline).released)

    def abort(self, request_id: str, reason: str = "", *, deadline: float | None = None) -> tuple[int, bool]:
        """See :meth:`AsyncClient.abort`."""
        resp = self._call("Abort", local_pb2.AbortRequest(request_id=request_id, reason=reason), deadline)
        return int(resp.aborted_pulls), bool(resp.aborted_publish)

    def drop_remote(
        self, request_id: str, remote_addresses: Sequence[str], reason: str = "", *, deadline: float | None = None
    ) -> int:
        """See :meth:`AsyncClient.drop_remote`."""
        req = local_pb2.AbortRequest(request_id=request_id, reason=reason, remote_addresses=list(remote_addresses))
        return int(self._call("Abort", req, deadline).remote_dropped)

    def drain(self, timeout_seconds: float = 0.0, *, deadline: float | None = None) -> dict[str, Any]:
        """See :meth:`AsyncClient.drain`."""
        return _status_dict(self._call("Drain", local_pb2.DrainRequest(timeout_seconds=timeout_seconds), deadline))

    def status(self, *, deadline: float | None = None) -> dict[str, Any]:
        """See :meth:`AsyncClient.status`."""
        return _status_dict(self._call("GetStatus", local_pb2.GetStatusRequest(), deadline))

    def wait_ready(self, within: float = 30.0) -> None:
        """Until the sidecar answers GetStatus."""
        deadline = time.monotonic() + within
        while True:
            try:
                self.status(deadline=min(2.0, max(deadline - time.monotonic(), 0.05)))
                return
            except KvxferRpcError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
