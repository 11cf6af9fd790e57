"""The sidecar's logic, independent of how requests arrive: register, publish, pull, abort, drain.

Prefill side: a worker *publishes* a request's blocks; they are held under a lease until every
decode rank that reads them confirms (peer ``Notify``), the lease expires, or someone aborts.

Decode side: a *pull* handshakes the prefill sidecars it needs (cached), asks each for the
published request, validates block ids, builds descriptors with :mod:`kvxfer.topology`, READs over
the data plane, and notifies the prefill side so it frees the blocks at once. Every failure ends
the pull with a status code and a message naming the field or peer; other pulls are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer import PROTOCOL_VERSION
from kvxfer._proto.kvxfer.v1 import local_pb2, peer_pb2
from kvxfer.config import ConfigError, Settings, parse_address
from kvxfer.errors import KvxferError
from kvxfer.layout import CacheKind, KVCacheLayout, head_range
from kvxfer.logs import get_logger, log_context
from kvxfer.memory import FdLookup, attach
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.batching import Coalescer
from kvxfer.server.convert import (
    blocks_from_proto,
    check_block_ids,
    check_id,
    layout_from_proto,
    memory_from_proto,
    rank_from_proto,
    rank_to_proto,
    regions_from_proto,
    regions_to_proto,
)
from kvxfer.server.dataplane import DataPlane
from kvxfer.server.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PeerUnavailableError,
    UnavailableError,
    grpc_code,
)
from kvxfer.server.events import CompletionHub, Kind
from kvxfer.server.identity import Identity, reader_differences, remote_sources
from kvxfer.server.peers import PeerDirectory, PeerSession, status_error
from kvxfer.server.state import Group, PublishEntry, PullEntry, ReaderKey, Registration
from kvxfer.topology import RankInfo, RegionTable, TransferTopology

__all__ = ["SidecarCore"]

log = get_logger("kvxfer.server")
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
PEER_CALL_SECONDS = 10.0  # cap on a single control-plane call to a peer
MAX_BATCH = 1024  # items in one PullBatch or GetPublishedBatch
LOOKUPS_PER_CALL = 64  # lookups a reader puts in one GetPublishedBatch


class SidecarCore:
    """All state and behaviour of one sidecar."""

    def __init__(
        self,
        settings: Settings,
        data_plane: DataPlane,
        metrics: SidecarMetrics,
        *,
        peer_address: str,
        channel_options: list[tuple[str, Any]],
        channel_credentials: grpc.ChannelCredentials | None,
        on_serving: Callable[[bool], None] = lambda _s: None,
        fd_lookup: FdLookup | None = None,
    ) -> None:
        self.settings = settings
        self._fd_lookup = fd_lookup
        self.dp = data_plane
        self.metrics = metrics
        self.peer_address = peer_address
        self.instance_id = uuid.uuid4().hex
        self.hub = CompletionHub()
        self.registration: Registration | None = None
        self.publishes: dict[str, PublishEntry] = {}
        self.pulls: dict[str, PullEntry] = {}
        self.readers: dict[ReaderKey, Identity] = {}  # sidecars that handshook us
        self.draining = False
        self._epoch = 0
        self._ids = itertools.count(1)
        self._on_serving = on_serving
        self._identity: Identity | None = None
        self._topologies: dict[tuple[Any, ...], TransferTopology] = {}
        self._all_readers: dict[tuple[Any, ...], set[int]] = {}
        self._sources: dict[tuple[Any, ...], set[int]] = {}
        self._regions_msg: dict[tuple[str, int], list[Any]] = {}
        # Per-peer batching of the two calls every pull owes its publishers (see batching.py).
        self._lookups: Coalescer[str, tuple[Any, float], Any] = Coalescer(self._send_lookups, self._spawn)
        self._notices: Coalescer[str, Any, None] = Coalescer(self._send_notices, self._spawn)
        self._unbatched: set[tuple[str, str]] = set()  # (address, instance) answering UNIMPLEMENTED to batches
        self._background: set[asyncio.Task[Any]] = set()
        # Gauges of the current state are read at scrape time: nothing to update on the hot path.
        metrics.leases_active.set_function(lambda: len(self.publishes))
        metrics.in_flight.set_function(lambda: len(self.pulls))
        metrics.peers.set_function(self._peer_count)
        self._drained: asyncio.Future[Any] | None = None
        self.drain_done = asyncio.Event()  # set once a drain has finished
        token = settings.token()
        md = (("authorization", f"Bearer {token}"),) if token else ()
        self.peers = PeerDirectory(
            me=self.identity, load_peer=data_plane.add_peer, forget_peer=data_plane.remove_peer,
            channel_options=channel_options, credentials=channel_credentials, metadata=md,
            on_handshake=lambda outcome: self.metrics.handshakes.labels(outcome=outcome).inc(),
        )  # fmt: skip

    # ================================================================== identity
    def identity(self) -> Identity:
        """This sidecar as its handshake describes it (needs a registration)."""
        reg = self._require_registration()
        if self._identity is None or self._identity.epoch != reg.epoch:
            self._identity = Identity(
                PROTOCOL_VERSION, self.settings.engine_id, self.instance_id, reg.epoch, reg.rank, reg.layouts,
                self.dp.backend, self.dp.agent_name, self.dp.metadata(), self.peer_address, self.settings.role,
            )  # fmt: skip
        return self._identity

    def _require_registration(self) -> Registration:
        if self.registration is None:
            raise FailedPreconditionError(
                "no KV caches registered with this sidecar yet (call RegisterCaches first)", field="groups"
            )
        return self.registration

    def _require_role(self, role: str, what: str) -> None:
        if self.settings.role not in (role, "both"):
            raise FailedPreconditionError(
                f"{what}: this sidecar runs with --role {self.settings.role}; {what} needs role {role} or both",
                field="role",
            )

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise UnavailableError(f"{what}: the sidecar is draining and accepts no new work", field="draining")

    def _peer_count(self) -> int:
        # Called from the metrics server's thread: copy the keys in one step before iterating.
        return len(self.peers) + len({k[:2] for k in tuple(self.readers)})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ================================================================== local API
    async def register_caches(self, req: Any) -> Any:
        """RegisterCaches: attach the worker's memory and register it with the data plane."""
        self._refuse_if_draining("RegisterCaches")
        if self.registration is not None and (self.publishes or self.pulls):
            raise FailedPreconditionError(
                f"groups: cannot replace the registration while {len(self.publishes)} requests are published and "
                f"{len(self.pulls)} pulls are in flight",
                field="groups",
            )
        rank = rank_from_proto(req.rank, "rank")
        held = self.registration
        if held is not None and (held.rank.tp_rank, held.rank.pp_rank) != (rank.tp_rank, rank.pp_rank):
            # Two ranks sharing a sidecar would silently replace each other's memory: refuse the second.
            raise FailedPreconditionError(
                f"rank: this sidecar serves tp rank {held.rank.tp_rank}/{held.rank.tp_size} pp rank "
                f"{held.rank.pp_rank}/{held.rank.pp_size} (worker {held.worker_id!r}); worker {req.worker_id!r} "
                f"registered tp rank {rank.tp_rank}/{rank.tp_size} pp rank {rank.pp_rank}/{rank.pp_size}. One sidecar "
                "serves one worker rank: run one sidecar per rank",
                field="rank",
            )
        if not req.groups:
            raise InvalidArgumentError("groups: at least one cache group is needed", field="groups")
        groups: dict[str, Group] = {}
        try:
            for i, g in enumerate(req.groups):
                name = check_id(g.name, f"groups[{i}].name")
                if name in groups:
                    raise InvalidArgumentError(f"groups[{i}].name: group {name!r} given twice", field="groups")
                layout = layout_from_proto(g.layout, f"groups[{i}].layout")
                _check_rank_heads(layout, rank, f"groups[{i}].layout")
                memory = attach(memory_from_proto(g.memory, f"groups[{i}].memory"), layout,
                                field=f"groups[{i}].memory", fds=self._fd_lookup)  # fmt: skip
                try:
                    handle = self.dp.register(memory.table, memory.mem_type)
                except BaseException:
                    memory.close()
                    raise
                groups[name] = Group(name, layout, memory, handle)
        except BaseException:
            self._release_groups(groups.values())
            raise
        old = self.registration
        self._epoch += 1
        self.registration = Registration(req.worker_id, rank, groups, self._epoch)
        self._identity = None
        self._topologies.clear()
        self._sources.clear()
        self._all_readers.clear()
        self._regions_msg.clear()
        if old is not None:
            self._release_groups(old.groups.values())
        self.metrics.registered_bytes.set(self.registration.nbytes)
        log.info(
            "caches registered",
            extra={"groups": ",".join(groups), "bytes": self.registration.nbytes, "epoch": self._epoch,
                   "tp_rank": rank.tp_rank, "tp_size": rank.tp_size},
        )  # fmt: skip
        if not self.draining:
            self._on_serving(True)
        return local_pb2.RegisterCachesResponse(
            engine_id=self.settings.engine_id, instance_id=self.instance_id, epoch=self._epoch,
            registered_bytes=self.registration.nbytes, backend=self.dp.backend, peer_address=self.peer_address,
        )  # fmt: skip

    def _release_groups(self, groups: Any) -> None:
        for g in groups:
            with contextlib.suppress(Exception):
                self.dp.deregister(g.dp_handle)
            g.memory.close()

    async def publish(self, req: Any) -> Any:
        """Publish: hold a request's blocks under a lease."""
        self._refuse_if_draining("Publish")
        self._require_role("prefill", "Publish")
        reg = self._require_registration()
        rid = check_id(req.request_id, "request_id")
        lease = float(req.lease_seconds)
        if not math.isfinite(lease) or lease < 0 or lease > 86400:
            raise InvalidArgumentError(f"lease_seconds: must be in [0, 86400], got {lease}", field="lease_seconds")
        lease = lease or self.settings.lease_seconds
        old = self.publishes.get(rid)
        if old is not None:
            raise AlreadyExistsError(
                f"request_id: {rid!r} is already published (lease expires in "
                f"{max(0.0, old.expires_at - time.monotonic()):.1f}s)",
                field="request_id",
            )
        blocks = blocks_from_proto(req.blocks, reg.layouts, "blocks")
        entry = PublishEntry(rid, blocks, lease, time.monotonic() + lease)
        self.publishes[rid] = entry
        self._arm_lease(entry)
        return local_pb2.PublishResponse(request_id=rid, expires_unix_ms=entry.expires_unix_ms)

    def _arm_lease(self, entry: PublishEntry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        delay = max(0.0, entry.expires_at - time.monotonic())
        entry.timer = asyncio.get_running_loop().call_later(delay, self._expire, entry)

    def _expire(self, entry: PublishEntry) -> None:
        if self.publishes.get(entry.request_id) is not entry:
            return
        if entry.expires_at > time.monotonic() + 1e-3:  # extended meanwhile
            self._arm_lease(entry)
            return
        del self.publishes[entry.request_id]
        self.metrics.lease_expirations.inc()
        msg = f"lease of {entry.lease_seconds:g}s expired before the decode side confirmed; blocks released"
        with log_context(request_id=entry.request_id):
            log.info("lease expired", extra={"lease_seconds": entry.lease_seconds})
        self.hub.emit(Kind.EXPIRED, entry.request_id, code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message=msg)

    def _drop_publish(self, rid: str) -> PublishEntry | None:
        entry = self.publishes.pop(rid, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        return entry

    async def release(self, req: Any) -> Any:
        """Release: drop a publish (the worker frees the blocks itself)."""
        rid = check_id(req.request_id, "request_id")
        return local_pb2.ReleaseResponse(released=self._drop_publish(rid) is not None)

    async def abort(self, req: Any) -> Any:
        """Abort: stop a request here and on its peers; frees blocks on both sides."""
        rid = check_id(req.request_id, "request_id")
        reason = req.reason or "aborted by the worker"
        addresses: list[str] = []
        if req.remote_addresses:  # checked before anything is stopped
            self._require_role("decode", "Abort with remote_addresses")
            addresses = _check_addresses(req.remote_addresses)
        resp = local_pb2.AbortResponse()
        entry = self._drop_publish(rid)
        if entry is not None:
            resp.aborted_publish = True
            self.hub.emit(Kind.ABORTED, rid, code=grpc.StatusCode.ABORTED.value[0], message=reason)
            self._spawn(self._abort_readers(entry, reason, skip=None))
        pull = self.pulls.get(rid)
        if pull is not None and pull.task is not None and not pull.task.done():
            pull.abort_reason = reason
            pull.task.cancel()
            resp.aborted_pulls = 1
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(pull.done), timeout=5.0)
        if addresses:
            peer_req = peer_pb2.PeerAbortRequest(
                request_id=rid, engine_id=self.settings.engine_id, instance_id=self.instance_id, reason=reason
            )
            dropped = await asyncio.gather(*(self._drop_remote(a, peer_req) for a in addresses))
            resp.remote_dropped = sum(dropped)
        return resp

    async def _drop_remote(self, address: str, req: Any) -> bool:
        """Ask a publisher to drop a request this side will not read (handshaking first if needed)."""
        try:
            # A publisher takes aborts only from a reader that handshook with it.
            await self.peers.session(address, budget=PEER_CALL_SECONDS)
            resp = await self.peers.call(
                address, "Abort", lambda s: s.Abort(req, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)
            )
        except KvxferError as exc:
            log.warning("could not ask a publisher to drop a request; its lease will expire",
                        extra={"peer": address, "error": exc.message})  # fmt: skip
            return False
        return bool(resp.found)

    async def _abort_readers(self, entry: PublishEntry, reason: str, skip: tuple[str, str] | None) -> None:
        calls = []
        for (engine, instance, _tp, _pp), address in entry.readers.items():
            if skip == (engine, instance) or not address:
                continue
            req = peer_pb2.PeerAbortRequest(
                request_id=entry.request_id, engine_id=self.settings.engine_id, instance_id=self.instance_id,
                reason=reason,
            )  # fmt: skip
            calls.append(self._peer_abort(address, req))
        await asyncio.gather(*calls, return_exceptions=True)

    async def _peer_abort(self, address: str, req: Any) -> None:
        try:
            await self.peers.call(
                address, "Abort", lambda s: s.Abort(req, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)
            )
        except KvxferError as exc:
            log.warning("could not tell a peer about an abort", extra={"peer": address, "error": exc.message})

    async def status(self, _req: Any) -> Any:
        """GetStatus."""
        reg = self.registration
        return local_pb2.StatusResponse(
            engine_id=self.settings.engine_id, instance_id=self.instance_id, role=self.settings.role,
            backend=self.dp.backend, registered=reg is not None, draining=self.draining,
            leases=len(self.publishes), transfers_in_flight=len(self.pulls), peers=len(self.peers),
            peer_address=self.peer_address, registered_bytes=reg.nbytes if reg else 0,
            protocol_version=PROTOCOL_VERSION, groups=list(reg.groups) if reg else [],
        )  # fmt: skip

    async def watch(self, req: Any) -> AsyncIterator[Any]:
        """WatchCompletions."""
        async for ev in self.hub.watch(replay=bool(req.replay), after=int(req.after_sequence)):
            yield ev

    # ================================================================== pull (decode side)
    async def pull(self, req: Any, client_timeout: float | None) -> Any:
        """Pull: validate, start the transfer, and answer when posted (or done, with ``wait``)."""
        self._refuse_if_draining("Pull")
        self._require_role("decode", "Pull")
        reg = self._require_registration()
        rid = check_id(req.request_id, "request_id")
        if req.remote_engine_id:
            check_id(req.remote_engine_id, "remote_engine_id")
        if not req.remote_addresses:
            raise InvalidArgumentError(
                "remote_addresses: give the peer API address of every remote TP rank's sidecar, in rank order",
                field="remote_addresses",
            )
        addresses = _check_addresses(req.remote_addresses)
        local_blocks = blocks_from_proto(req.local_blocks, reg.layouts, "local_blocks")
        remote_given = _parse_remote_blocks(req.remote_blocks, reg.layouts)
        timeout = float(req.timeout_seconds)
        if not math.isfinite(timeout) or timeout < 0:
            raise InvalidArgumentError(f"timeout_seconds: must be >= 0, got {timeout}", field="timeout_seconds")
        timeout = min(timeout or self.settings.transfer_timeout_seconds, self.settings.transfer_timeout_seconds)
        if client_timeout is not None:
            timeout = min(timeout, max(client_timeout - 0.05, 0.01))
        if rid in self.pulls:
            raise AlreadyExistsError(f"request_id: a pull of {rid!r} is already in flight", field="request_id")
        now = time.monotonic()
        entry = PullEntry(
            f"{self.instance_id[:8]}-{next(self._ids)}",
            rid,
            req.remote_engine_id,
            addresses,
            now + timeout,
            now,
            spans=_token_spans(req.local_blocks, req.remote_blocks),
        )
        self.pulls[rid] = entry
        entry.task = asyncio.get_running_loop().create_task(
            self._run_pull(entry, reg, local_blocks, remote_given, timeout)
        )
        wait_for = entry.done if req.wait else asyncio.ensure_future(_first(entry.posted, entry.done))
        try:
            await asyncio.shield(wait_for)
        except asyncio.CancelledError:
            # The worker gave up on a waiting Pull (cancelled or its deadline passed): abort it.
            if req.wait and entry.task is not None and not entry.task.done():
                entry.abort_reason = "the worker cancelled its Pull call"
                entry.task.cancel()
            raise
        failure = entry.done.exception() if entry.done.done() else None
        if failure is not None:
            raise failure
        resp = local_pb2.PullResponse(transfer_id=entry.transfer_id, request_id=rid, done=entry.done.done())
        if entry.done.done():
            resp.stats.CopyFrom(entry.done.result())
        return resp

    async def pull_batch(self, req: Any, client_timeout: float | None) -> Any:
        """PullBatch: every pull runs as if it came alone; each gets its own result, in order."""
        n = len(req.pulls)
        if not 1 <= n <= MAX_BATCH:
            raise InvalidArgumentError(f"pulls: {n} pulls in one PullBatch; give 1 to {MAX_BATCH}", field="pulls")

        async def one(p: Any) -> Any:
            with log_context(request_id=p.request_id or None, peer=p.remote_engine_id or None):
                try:
                    return local_pb2.PullResult(response=await self.pull(p, client_timeout))
                except KvxferError as exc:
                    return local_pb2.PullResult(code=grpc_code(exc).value[0], message=exc.message)
                except Exception as exc:  # a bug: answer it for this pull, keep the others
                    log.exception("pull failed unexpectedly")
                    return local_pb2.PullResult(
                        code=grpc.StatusCode.INTERNAL.value[0], message=f"internal error: {type(exc).__name__}: {exc}"
                    )

        # Tasks start in order and each registers its request id before its first await, so a
        # repeated id within the batch is refused (ALREADY_EXISTS) like a second Pull would be.
        return local_pb2.PullBatchResponse(results=await asyncio.gather(*(one(p) for p in req.pulls)))

    async def _run_pull(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64],
        budget: float,
    ) -> None:  # fmt: skip
        rid = entry.request_id
        outcome, reason = "ok", ""
        stats: Any = None
        err: KvxferError | None = None
        sessions: dict[int, PeerSession] = {}
        peer = entry.remote_engine_id or ",".join(entry.addresses)
        with log_context(request_id=rid, transfer_id=entry.transfer_id, peer=peer):
            try:
                async with asyncio.timeout(budget):
                    stats = await self._pull_steps(entry, reg, local_blocks, remote_given, sessions)
            except TimeoutError:
                outcome, reason = "timeout", "timeout"
                err = DeadlineError(
                    f"pull of {rid!r} did not finish within {budget:.3g}s (while {entry.stage})",
                    field="timeout_seconds",
                )
                for s in sessions.values():
                    if entry.stage.startswith("reading"):
                        self.peers.invalidate(s.address, reconnect=True)
            except asyncio.CancelledError:
                outcome, reason = "aborted", "aborted"
                why = entry.abort_reason or "the sidecar is shutting down"
                err = AbortedError(f"pull of {rid!r} aborted: {why}", field="request_id")
            except KvxferError as exc:
                outcome, reason, err = "failed", _reason(exc), exc
            except Exception as exc:  # a bug: keep the sidecar serving, report it
                log.exception("pull failed unexpectedly")
                outcome, reason = "failed", "internal"
                err = KvxferError(f"internal error in pull of {rid!r}: {type(exc).__name__}: {exc}")
            finally:
                self.pulls.pop(rid, None)
            elapsed = time.monotonic() - entry.started
            code = 0 if err is None else grpc_code(err).value[0]
            if err is None:
                if not entry.done.done():
                    entry.done.set_result(stats)
                # Bookkeeping runs after the waiting Pull handler (woken by set_result, so scheduled
                # first) has answered the worker: it is off the worker's critical path.
                asyncio.get_running_loop().call_soon(self._pulled, entry, stats, elapsed)
            else:
                self.metrics.transfer_done("read", outcome, nbytes=0, descriptors=0, seconds=elapsed, reason=reason)  # type: ignore[arg-type]
                kind = Kind.ABORTED if outcome == "aborted" else Kind.PULL_FAILED
                self.hub.emit(kind, rid, transfer_id=entry.transfer_id, code=code, message=err.message,
                              peer=entry.remote_engine_id)  # fmt: skip
                log.info("pull ended", extra={"outcome": outcome, "error": err.message})
                if outcome == "aborted" and not entry.abort_from_peer:
                    self._abort_publishers(entry, err.message)
                elif outcome != "aborted":
                    self._notify_publishers(entry, "failed", err.message, 0)
                else:
                    entry.contacted.clear()
                    self._notify_publishers(entry, "failed", err.message, 0)  # only the unread replicas
                if not entry.posted.done():
                    entry.posted.set_exception(err)
                    entry.posted.exception()
                if not entry.done.done():
                    entry.done.set_exception(err)
                    entry.done.exception()  # retrieved: a non-waiting Pull never awaits it

    def _pulled(self, entry: PullEntry, stats: Any, elapsed: float) -> None:
        self.metrics.transfer_done("read", "ok", nbytes=stats.bytes, descriptors=stats.descriptors, seconds=elapsed)
        self.hub.emit(
            Kind.PULLED, entry.request_id, transfer_id=entry.transfer_id, peer=entry.remote_engine_id, stats=stats
        )
        log.debug("pull done", extra={"bytes": stats.bytes, "descriptors": stats.descriptors,
                                      "seconds": round(elapsed, 6)})  # fmt: skip
        self._notify_publishers(entry, "done", "", stats.bytes)

    async def _pull_steps(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64],
        sessions: dict[int, PeerSession],
    ) -> Any:  # fmt: skip
        remote_tp = len(entry.addresses)
        # 1. Which remote ranks hold what this rank needs (local layout alone).
        entry.stage = "planning sources"
        needed: set[int] = set()
        for name, g in reg.groups.items():
            try:
                key = (name, reg.epoch, remote_tp)
                got = self._sources.get(key)
                if got is None:
                    got = self._sources[key] = remote_sources(g.layout, reg.rank, remote_tp)
                needed |= got
            except KvxferError as exc:
                raise FailedPreconditionError(
                    f"remote_addresses: {remote_tp} remote ranks do not fit group {name!r}: {exc.message}",
                    field="remote_addresses",
                ) from None
        ranks = sorted(needed)
        if reg.rank.tp_rank == 0:
            # Remote ranks that no local rank reads (replicated heads or MLA latents) would hold their
            # blocks until the lease expires; local rank 0 tells them to free at once.
            everyone = self._ranks_read_by_all(reg, remote_tp)
            entry.unread = [entry.addresses[q] for q in range(remote_tp) if q not in everyone]
        # 2. Handshake (cached) and fetch the published request from each needed rank.
        entry.stage = "contacting " + ", ".join(entry.addresses[q] for q in ranks)
        t_fetch = time.monotonic()
        if len(ranks) == 1:  # the common case: no task per rank
            fetched = [await self._fetch(entry, ranks[0], sessions)]
        else:
            fetched = await asyncio.gather(*(self._fetch(entry, q, sessions) for q in ranks))
        fetch_seconds = time.monotonic() - t_fetch
        published = dict(zip(ranks, fetched, strict=True))
        # 3. Validate and build descriptors per remote rank.
        entry.stage = "building descriptors"
        per_rank: dict[int, list[tuple[U64, U64]]] = {q: [] for q in ranks}
        warnings: list[str] = []
        for name, g in reg.groups.items():
            by_list: dict[bytes, list[int]] = {}
            chosen: dict[bytes, I64] = {}
            given = remote_given.get(name)
            for q in ranks:
                rids = published[q][0][name]
                if given is not None:
                    # A reader may take any part of a publish (e.g. the tail its own prefix cache lacks), but
                    # nothing beyond it: ids that were not published are refused before any descriptor exists.
                    unknown = _not_published(given, rids)
                    if unknown:
                        raise InvalidArgumentError(
                            f"remote_blocks[{name}]: {unknown} (remote rank {q} at {entry.addresses[q]} published "
                            f"{rids.size} blocks)",
                            field=f"remote_blocks[{name}]",
                        )
                ids_key = rids.tobytes()
                by_list.setdefault(ids_key, []).append(q)
                chosen[ids_key] = given if given is not None else rids
            for ids_key, qs in by_list.items():
                session = sessions[qs[0]]
                topo = self._topology(name, g.layout, session.identity.groups[name], reg.rank, remote_tp)
                rids = chosen[ids_key]
                try:
                    num_tokens, local_skip, remote_skip = entry.spans.get(name, (None, 0, 0))
                    plan = topo.plan(local_blocks[name], rids, num_tokens=num_tokens, local_skip=local_skip,
                                     remote_skip=remote_skip)  # fmt: skip
                except KvxferError as exc:
                    field = exc.field or "blocks"
                    raise InvalidArgumentError(f"{field}[{name}]: {exc.message.split(': ', 1)[-1]}",
                                               field=f"{field}[{name}]") from None  # fmt: skip
                warnings.extend(plan.warnings)
                for rp in plan.per_rank:
                    if rp.remote_rank not in qs:
                        continue
                    remote_table = published[rp.remote_rank][1][name]
                    per_rank[rp.remote_rank].append(rp.descriptors(g.memory.table, remote_table))
        # 4. READ from every remote rank at once.
        entry.stage = "reading from " + ", ".join(f"rank {q} ({entry.addresses[q]})" for q in ranks)
        total_bytes = 0
        total_desc = 0
        reads = []
        mem_type = next(iter(reg.groups.values())).memory.mem_type
        for q, parts in per_rank.items():
            if not parts:
                continue
            local = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
            remote = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            total_bytes += int(local[:, 1].sum())
            total_desc += int(local.shape[0])
            reads.append(self._read(entry, sessions[q], local, remote, mem_type, published[q][2]))
        t0 = time.monotonic()
        if not entry.posted.done():
            entry.posted.set_result(None)
        await _gather_or_cancel(reads)
        data_seconds = time.monotonic() - t0
        entry.stage = "done"
        return local_pb2.TransferStats(
            bytes=total_bytes, descriptors=total_desc, duration_seconds=time.monotonic() - entry.started,
            data_seconds=data_seconds, remote_ranks=ranks, warnings=sorted(set(warnings)), fetch_seconds=fetch_seconds,
        )  # fmt: skip

    async def _fetch(
        self, entry: PullEntry, q: int, sessions: dict[int, PeerSession]
    ) -> tuple[dict[str, I64], dict[str, RegionTable], str]:
        """Handshake rank ``q`` (cached) and get the published request from it."""
        address = entry.addresses[q]
        me = self.identity()
        for attempt in range(2):
            remaining = max(entry.deadline - time.monotonic(), 0.001)
            session = await self.peers.session(address, budget=remaining)
            them = session.identity
            problems = []
            if them.rank.tp_rank != q or them.rank.tp_size != len(entry.addresses):
                problems.append(
                    f"it is tp rank {them.rank.tp_rank}/{them.rank.tp_size}, but remote_addresses[{q}] must be rank "
                    f"{q}/{len(entry.addresses)}"
                )
            if entry.remote_engine_id and them.engine_id != entry.remote_engine_id:
                problems.append(f"it is engine {them.engine_id!r}, not {entry.remote_engine_id!r}")
            if problems:
                raise FailedPreconditionError(
                    f"remote_addresses[{q}]: the sidecar at {address} does not match: " + "; ".join(problems),
                    field=f"remote_addresses[{q}]",
                )
            sessions[q] = session
            req = peer_pb2.GetPublishedRequest(
                request_id=entry.request_id, engine_id=me.engine_id, instance_id=me.instance_id,
                rank=rank_to_proto(me.rank),
            )  # fmt: skip
            if address not in entry.asked:
                entry.asked.append(address)  # an abort from here on must reach it, answered or not
            try:
                resp = await self._lookups.submit(address, (req, entry.deadline))
            except NotFoundError:
                raise NotFoundError(
                    f"request_id: {entry.request_id!r} is not published on {them.label} at {address} "
                    "(unknown, already released, or its lease expired)",
                    field="request_id",
                ) from None
            except FailedPreconditionError as exc:
                if attempt == 0 and "has not handshaken" in exc.message:
                    self.peers.invalidate(address)  # the peer restarted and forgot us
                    continue
                raise
            if resp.instance_id != them.instance_id or resp.epoch != them.epoch:
                # The peer restarted or re-registered its memory: its data-plane metadata changed.
                self.peers.invalidate(address)
                if attempt == 0:
                    continue
                raise PeerUnavailableError(f"peer {address} changed while being contacted", field="remote_addresses")
            entry.contacted.append(address)
            blocks: dict[str, I64] = {}
            tables: dict[str, RegionTable] = {}
            mem_type = "DRAM"
            for pg in resp.groups:
                layout = them.groups.get(pg.name)
                if layout is None:
                    raise PeerUnavailableError(f"peer {address} published unknown group {pg.name!r}", field="groups")
                # What a peer sends is checked like a worker's input: the READ may only touch the
                # regions its handshake announced, through block ids inside its layout.
                try:
                    blocks[pg.name] = check_block_ids(
                        np.asarray(pg.block_ids, dtype=np.int64), layout.num_blocks,
                        f"peer {address} published block_ids[{pg.name}]",
                    )  # fmt: skip
                    tables[pg.name] = self._remote_regions(session, pg, layout)
                except InvalidArgumentError as exc:
                    msg = f"{exc.message}; refusing to read"
                    raise FailedPreconditionError(msg, field="remote_addresses") from None
                mem_type = pg.memory_type or "DRAM"
            return blocks, tables, mem_type
        raise PeerUnavailableError(f"peer {address}: could not get a stable handshake", field="remote_addresses")

    @staticmethod
    def _remote_regions(session: PeerSession, pg: Any, layout: KVCacheLayout) -> RegionTable:
        """A publisher's region table; fixed for one instance and epoch, so parsed once per session."""
        raw = tuple((r.base, r.size, r.device) for r in pg.regions)
        cached = session.regions.get(pg.name)
        if cached is not None and cached[0] == raw:
            table: RegionTable = cached[1]
            return table
        table = regions_from_proto(pg.regions, layout, f"peer {session.address} regions[{pg.name}]")
        session.regions[pg.name] = (raw, table)
        return table

    def _ranks_read_by_all(self, reg: Registration, remote_tp: int) -> set[int]:
        key = ("<all>", reg.epoch, remote_tp)
        cached = self._all_readers.get(key)
        if cached is None:
            cached = set()
            for g in reg.groups.values():
                for r in range(reg.rank.tp_size):
                    rank = RankInfo(r, reg.rank.tp_size, reg.rank.pp_rank, reg.rank.pp_size)
                    cached |= remote_sources(g.layout, rank, remote_tp)
            self._all_readers[key] = cached
        return cached

    def _topology(
        self, name: str, local: KVCacheLayout, remote: KVCacheLayout, rank: RankInfo, remote_tp: int
    ) -> TransferTopology:
        key = (name, local, remote, rank, remote_tp)
        topo = self._topologies.get(key)
        if topo is None:
            if len(self._topologies) > 256:
                self._topologies.clear()
            topo = TransferTopology(local, remote, rank, remote_tp, rank.pp_size)
            self._topologies[key] = topo
        return topo

    async def _read(self, entry: PullEntry, s: PeerSession, local: U64, remote: U64, mem: str, rmem: str) -> None:
        remaining = max(entry.deadline - time.monotonic(), 0.001)
        try:
            await self.dp.read(s.dp_name, local, remote, mem_type=mem, remote_mem_type=rmem, budget=remaining)
        except KvxferError as exc:
            self.peers.invalidate(s.address, reconnect=True)
            if exc.status == "DEADLINE_EXCEEDED":
                raise DeadlineError(
                    f"data plane READ from {s.identity.label} at {s.address} did not finish within {remaining:.3g}s "
                    f"(while {entry.stage}): {exc.message}",
                    field="timeout_seconds",
                ) from None
            raise PeerUnavailableError(
                f"data plane READ from {s.identity.label} at {s.address} failed: {exc.message}",
                field="remote_addresses",
            ) from None

    def _notify_publishers(self, entry: PullEntry, outcome: str, message: str, nbytes: int) -> None:
        reg = self.registration
        if reg is None:
            return
        kinds = {"done": peer_pb2.NotifyRequest.DONE, "failed": peer_pb2.NotifyRequest.FAILED}

        def request(kind: Any, msg: str, n: int) -> Any:
            return peer_pb2.NotifyRequest(
                request_id=entry.request_id, engine_id=self.settings.engine_id, instance_id=self.instance_id,
                rank=rank_to_proto(reg.rank), message=msg, bytes=n, outcome=kind,
            )  # fmt: skip

        for address in entry.contacted:
            self._queue_notice(address, request(kinds[outcome], message, nbytes))
        if entry.unread:
            unread = request(peer_pb2.NotifyRequest.UNREAD, "no decode rank reads this replica", 0)
            for address in entry.unread:
                self._queue_notice(address, unread)

    async def _send_lookups(self, address: str, asks: list[tuple[Any, float]]) -> list[Any]:
        """GetPublished for every queued pull of one peer: one call, or one GetPublishedBatch for several."""
        if len(asks) > LOOKUPS_PER_CALL:
            # Answers carry every block id: long prompts in large batches would outgrow the message limit.
            n = LOOKUPS_PER_CALL
            chunks = [asks[i : i + n] for i in range(0, len(asks), n)]
            parts = await asyncio.gather(*(self._send_lookups(address, c) for c in chunks), return_exceptions=True)
            # A chunk that failed as a whole fails its own lookups only.
            return [r for c, part in zip(chunks, parts, strict=True) for r in (
                [part] * len(c) if isinstance(part, BaseException) else part)]  # fmt: skip
        # The call may run as long as the most patient pull in it; each pull still ends at its own deadline.
        timeout = min(max(max(d for _, d in asks) - time.monotonic(), 0.001), PEER_CALL_SECONDS)
        md = self.peers.metadata
        session = self.peers.current(address)
        peer = (address, session.identity.instance_id if session else "")
        if len(asks) > 1 and peer not in self._unbatched:
            batch = peer_pb2.GetPublishedBatchRequest(requests=[r for r, _ in asks])
            try:
                resp = await self.peers.call(
                    address, "GetPublishedBatch", lambda s: s.GetPublishedBatch(batch, timeout=timeout, metadata=md)
                )
            except KvxferError as exc:
                if exc.status != "UNIMPLEMENTED":
                    raise
                self._unbatched.add(peer)  # an older kvxfer (until it restarts): one request per call
            else:
                if len(resp.results) != len(asks):  # what a peer sends is checked like a worker's input
                    raise PeerUnavailableError(
                        f"peer {address} answered {len(resp.results)} results to {len(asks)} lookups",
                        field="remote_addresses",
                    )
                return [
                    r.response if r.code == 0 else status_error(r.code, r.message, address, "GetPublished")
                    for r in resp.results
                ]

        async def one(req: Any) -> Any:
            try:
                return await self.peers.call(
                    address, "GetPublished", lambda s: s.GetPublished(req, timeout=timeout, metadata=md)
                )
            except KvxferError as exc:
                return exc

        if len(asks) == 1:
            return [await one(asks[0][0])]
        return list(await asyncio.gather(*(one(r) for r, _ in asks)))

    def _queue_notice(self, address: str, req: Any) -> None:
        """Send a completion notice; notices owed to one peer while a send is under way go as one batch."""
        self._notices.submit(address, req)

    async def _send_notices(self, address: str, batch: list[Any]) -> list[None]:
        if len(batch) == 1:
            what, msg = "Notify", batch[0]
        else:
            what, msg = "NotifyBatch", peer_pb2.NotifyBatchRequest(notices=batch)

        def send(stub: Any) -> Any:
            return getattr(stub, what)(msg, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)

        try:
            if any(n.outcome == peer_pb2.NotifyRequest.UNREAD for n in batch):
                # A replica this rank never read from only takes notices from a sidecar it knows.
                await self.peers.session(address, budget=PEER_CALL_SECONDS)
            await self.peers.call(address, what, send)
        except Exception as exc:  # nobody awaits a notice: whatever went wrong is logged here
            error = exc.message if isinstance(exc, KvxferError) else f"{type(exc).__name__}: {exc}"
            log.warning("completion notices not delivered; the peer's leases will expire", extra={
                "peer": address, "error": error, "notices": len(batch)})  # fmt: skip
        return [None] * len(batch)

    def _abort_publishers(self, entry: PullEntry, reason: str) -> None:
        req = peer_pb2.PeerAbortRequest(
            request_id=entry.request_id, engine_id=self.settings.engine_id, instance_id=self.instance_id,
            reason=reason,
        )  # fmt: skip
        for address in entry.asked:
            self._spawn(self._peer_abort(address, req))

    # ================================================================== peer API (publisher side)
    async def peer_handshake(self, req: Any) -> Any:
        """Handshake: refuse incompatible readers with every difference listed."""
        try:
            reader = Identity.from_proto(req.info, "info")
        except KvxferError:
            self.metrics.handshakes.labels(outcome="failed").inc()
            raise
        me = self.identity()
        diffs = reader_differences(reader, me)
        if diffs:
            self.metrics.handshakes.labels(outcome="refused").inc()
            log.warning("handshake refused", extra={"peer": reader.label, "differences": "; ".join(diffs)})
            raise FailedPreconditionError(
                f"incompatible peer: {reader.label} cannot read from {me.label} (local = the reader, remote = this "
                "sidecar): " + "; ".join(diffs),
                field="info",
            )
        key = (reader.engine_id, reader.instance_id, reader.rank.tp_rank, reader.rank.pp_rank)
        # A restarted reader gets a new instance id: forget its old ones.
        for old in [k for k in self.readers if k[0] == key[0] and k[2:] == key[2:] and k[1] != key[1]]:
            del self.readers[old]
        self.readers[key] = reader
        self.metrics.handshakes.labels(outcome="ok").inc()
        return peer_pb2.HandshakeResponse(info=me.to_proto())

    async def peer_get_published(self, req: Any) -> Any:
        """GetPublished: a reader asks for a published request's blocks and regions."""
        rid = check_id(req.request_id, "request_id")
        reg = self._require_registration()
        entry = self.publishes.get(rid)
        if entry is None:
            raise NotFoundError(
                f"request_id: {rid!r} is not published on {self.settings.engine_id} (unknown, released or expired)",
                field="request_id",
            )
        rank = rank_from_proto(req.rank, "rank")
        key = (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank)
        reader = self.readers.get(key)
        if reader is None:
            raise FailedPreconditionError(
                f"engine_id: reader {req.engine_id!r} (instance {req.instance_id}) has not handshaken with this "
                "sidecar; handshake first",
                field="engine_id",
            )
        if entry.expected_readers is None or entry.reader_tp_size != rank.tp_size:
            entry.expected_readers = self._expected_readers(reader, rank.tp_size, reg)
            entry.reader_tp_size = rank.tp_size
        entry.readers[key] = reader.address
        # Hold the blocks at least as long as this reader may take to read them.
        hold = time.monotonic() + self.settings.transfer_timeout_seconds
        if entry.expires_at < hold:
            entry.expires_at = hold
        resp = peer_pb2.GetPublishedResponse(
            request_id=rid, instance_id=self.instance_id, epoch=reg.epoch, expires_unix_ms=entry.expires_unix_ms
        )
        for name, g in reg.groups.items():
            resp.groups.append(
                peer_pb2.PublishedGroup(
                    name=name, block_ids=entry.blocks[name].tolist(), regions=self._regions_of(name, reg),
                    memory_type=g.memory.mem_type,
                )
            )  # fmt: skip
        return resp

    def _regions_of(self, name: str, reg: Registration) -> list[Any]:
        key = (name, reg.epoch)
        msgs = self._regions_msg.get(key)
        if msgs is None:
            msgs = self._regions_msg[key] = regions_to_proto(reg.groups[name].memory.table)
        return msgs

    def _expected_readers(self, reader: Identity, tp_size: int, reg: Registration) -> set[int]:
        """Reader TP ranks that read from this rank, for every group (who must confirm)."""
        out: set[int] = set()
        for name, g in reg.groups.items():
            theirs = reader.groups.get(name)
            if theirs is None:
                continue
            for r in range(tp_size):
                rank = RankInfo(r, tp_size, reader.rank.pp_rank, reader.rank.pp_size)
                try:
                    topo = self._topology(f"<{name}", theirs, g.layout, rank, reg.rank.tp_size)
                except KvxferError:
                    continue
                if any(s.remote_rank == reg.rank.tp_rank for s in topo.sources()):
                    out.add(r)
        return out or {reader.rank.tp_rank}

    async def peer_notify(self, req: Any) -> Any:
        """Notify: a reader is done; free the blocks once every expected reader is."""
        rid = check_id(req.request_id, "request_id")
        entry = self.publishes.get(rid)
        if entry is None:
            return peer_pb2.NotifyResponse(released=False)
        rank = rank_from_proto(req.rank, "rank")
        if req.outcome == peer_pb2.NotifyRequest.UNREAD:
            known = any(k[0] == req.engine_id and k[1] == req.instance_id for k in self.readers)
        else:
            known = (req.engine_id, req.instance_id, rank.tp_rank, rank.pp_rank) in entry.readers
        if not known:
            # Only a reader that handshook (UNREAD) or fetched this request (DONE/FAILED) may free its blocks.
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}, tp rank {rank.tp_rank}) "
                f"{'has not handshaken with' if req.outcome == peer_pb2.NotifyRequest.UNREAD else 'did not fetch'} "
                f"{rid!r} from this sidecar; notice refused",
                field="engine_id",
            )
        if req.outcome == peer_pb2.NotifyRequest.UNREAD and not entry.readers:
            self._drop_publish(rid)
            msg = f"no rank of {req.engine_id} reads this rank's copy (replicated elsewhere); released"
            self.hub.emit(Kind.RELEASED, rid, message=msg, peer=req.engine_id)
            return peer_pb2.NotifyResponse(released=True)
        if req.outcome == peer_pb2.NotifyRequest.UNREAD:
            return peer_pb2.NotifyResponse(released=False)  # someone did read it: wait for them
        entry.done_readers.add(rank.tp_rank)
        if req.outcome == peer_pb2.NotifyRequest.FAILED:
            entry.failures.append(f"{req.engine_id}[tp {rank.tp_rank}]: {req.message}")
        expected = entry.expected_readers or {rank.tp_rank}
        if not expected <= entry.done_readers:
            return peer_pb2.NotifyResponse(released=False)
        self._drop_publish(rid)
        if entry.failures:
            code = grpc.StatusCode.UNAVAILABLE.value[0]
            msg = "decode side gave up: " + "; ".join(entry.failures) + "; blocks released"
        else:
            code, msg = 0, f"decode side ({req.engine_id}) has the blocks; released"
        self.hub.emit(Kind.RELEASED, rid, code=code, message=msg, peer=req.engine_id)
        return peer_pb2.NotifyResponse(released=True)

    async def peer_get_published_batch(self, req: Any) -> Any:
        """GetPublishedBatch: several lookups, each answered (or refused) on its own."""
        if len(req.requests) > MAX_BATCH:
            raise InvalidArgumentError(
                f"requests: {len(req.requests)} lookups in one GetPublishedBatch; at most {MAX_BATCH}",
                field="requests",
            )
        out = peer_pb2.GetPublishedBatchResponse()
        for r in req.requests:
            try:
                out.results.add(response=await self.peer_get_published(r))
            except KvxferError as exc:  # one unknown request must not cost the others
                out.results.add(code=grpc_code(exc).value[0], message=exc.message)
        return out

    async def peer_notify_batch(self, req: Any) -> Any:
        """NotifyBatch: several notices at once."""
        released = 0
        for n in req.notices:
            try:
                released += int((await self.peer_notify(n)).released)
            except KvxferError as exc:  # one bad notice must not cost the others
                log.warning("completion notice refused", extra={"peer": n.engine_id, "error": exc.message})
        return peer_pb2.NotifyBatchResponse(released=released)

    async def peer_abort(self, req: Any) -> Any:
        """Abort from a peer: drop our publish and/or cancel our pull of that request."""
        rid = check_id(req.request_id, "request_id")
        reader = any(k[0] == req.engine_id and k[1] == req.instance_id for k in self.readers)
        publishers = {
            s.address for s in self.peers.sessions()
            if s.identity.engine_id == req.engine_id and s.identity.instance_id == req.instance_id
        }  # fmt: skip
        if not reader and not publishers:
            raise FailedPreconditionError(
                f"engine_id: {req.engine_id!r} (instance {req.instance_id!r}) has not handshaken with this sidecar; "
                f"abort of {rid!r} refused",
                field="engine_id",
            )
        reason = f"aborted by peer {req.engine_id}" + (f": {req.reason}" if req.reason else "")
        found = False
        entry = self._drop_publish(rid) if reader else None
        if entry is not None:
            found = True
            self.hub.emit(Kind.ABORTED, rid, code=grpc.StatusCode.ABORTED.value[0], message=reason, peer=req.engine_id)
            self._spawn(self._abort_readers(entry, reason, skip=(req.engine_id, req.instance_id)))
        pull = self.pulls.get(rid)
        if (
            pull is not None and pull.task is not None and not pull.task.done()
            and not publishers.isdisjoint(pull.addresses)
        ):  # fmt: skip
            found = True
            pull.abort_reason, pull.abort_from_peer = reason, True
            pull.task.cancel()
        return peer_pb2.PeerAbortResponse(found=found)

    # ================================================================== drain / shutdown
    async def drain(self, budget: float | None = None) -> Any:
        """Refuse new work, let in-flight pulls and published leases finish, then release the rest."""
        if self._drained is not None:
            return await asyncio.shield(self._drained)
        self._drained = asyncio.get_running_loop().create_future()
        self.draining = True
        self._on_serving(False)
        budget = self.settings.drain_seconds if budget is None else budget
        log.info("draining", extra={"budget_seconds": budget, "pulls": len(self.pulls), "leases": len(self.publishes)})
        deadline = time.monotonic() + budget
        start_pulls = len(self.pulls)
        while (self.pulls or self.publishes) and time.monotonic() < deadline:  # noqa: ASYNC110 - two dicts to watch
            await asyncio.sleep(min(0.02, max(deadline - time.monotonic(), 0)))
        abandoned = len(self.pulls)
        for p in list(self.pulls.values()):
            if p.task is not None:
                p.abort_reason = "the sidecar's drain budget ran out"
                p.task.cancel()
        for p in list(self.pulls.values()):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(p.done), timeout=2.0)
        released = 0
        for rid in list(self.publishes):
            entry = self._drop_publish(rid)
            if entry is not None:
                released += 1
                with log_context(request_id=rid):
                    log.info("lease released by the drain")
                self.hub.emit(Kind.RELEASED, rid, code=grpc.StatusCode.UNAVAILABLE.value[0],
                              message="sidecar drained before the decode side confirmed; blocks released")  # fmt: skip
        resp = local_pb2.DrainResponse(
            completed=max(start_pulls - abandoned, 0), abandoned=abandoned, released_leases=released
        )
        log.info("drained", extra={"abandoned": abandoned, "released_leases": released})
        self._drained.set_result(resp)
        self.drain_done.set()
        return resp

    async def close(self) -> None:
        """Cancel everything and release memory (after the servers stopped)."""
        for p in list(self.pulls.values()):
            if p.task is not None:
                p.abort_reason = "the sidecar is stopping"
                p.task.cancel()
        tasks = [p.task for p in self.pulls.values() if p.task is not None] + list(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for rid in list(self.publishes):
            self._drop_publish(rid)
        self.hub.close()
        await self.peers.close()
        if self.registration is not None:
            self._release_groups(self.registration.groups.values())
            self.registration = None
        self.dp.close()


# ---------------------------------------------------------------------- helpers
def _check_rank_heads(layout: KVCacheLayout, rank: RankInfo, field: str) -> None:
    if layout.kind in (CacheKind.MLA, CacheKind.MAMBA):
        return
    try:
        h0, h1 = head_range(layout.total_kv_heads, rank.tp_size, rank.tp_rank)
    except KvxferError as exc:
        raise InvalidArgumentError(f"{field}: {exc.message}", field=f"{field}.total_kv_heads") from None
    if h1 - h0 != layout.num_kv_heads:
        raise InvalidArgumentError(
            f"{field}.num_kv_heads: rank {rank.tp_rank}/{rank.tp_size} holds {h1 - h0} of {layout.total_kv_heads} "
            f"heads, the layout says {layout.num_kv_heads}",
            field=f"{field}.num_kv_heads",
        )


def _check_addresses(values: Any) -> list[str]:
    """Peer API addresses of remote ranks: each one parseable, none twice."""
    addresses = list(values)
    for i, a in enumerate(addresses):
        try:
            parse_address(a, setting=f"remote_addresses[{i}]")
        except ConfigError as exc:
            raise InvalidArgumentError(exc.message, field=exc.field) from None
    if len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(
            f"remote_addresses: an address appears twice in {addresses}", field="remote_addresses"
        )
    return addresses


def _parse_remote_blocks(lists: Any, layouts: dict[str, KVCacheLayout]) -> dict[str, I64]:
    if not lists:
        return {}
    out: dict[str, I64] = {}
    for i, bl in enumerate(lists):
        if bl.group not in layouts:
            raise InvalidArgumentError(
                f"remote_blocks[{i}].group: unknown cache group {bl.group!r}; registered: {', '.join(layouts)}",
                field=f"remote_blocks[{i}].group",
            )
        ids = np.asarray(bl.block_ids, dtype=np.int64)
        out[bl.group] = check_block_ids(ids, 2**62, f"remote_blocks[{bl.group}]")
    return out


def _token_spans(local: Any, remote: Any) -> dict[str, tuple[int | None, int, int]]:
    """Per group: (tokens to move or None for all, local skip, remote skip) from the block lists."""
    remote_skip = {bl.group: int(bl.skip_tokens) for bl in remote}
    out: dict[str, tuple[int | None, int, int]] = {}
    for bl in local:
        skip_r = remote_skip.get(bl.group, 0)
        if bl.num_tokens or bl.skip_tokens or skip_r:
            out[bl.group] = (int(bl.num_tokens) or None, int(bl.skip_tokens), skip_r)
    return out


def _not_published(given: I64, published: I64) -> str:
    """'' when every id of ``given`` was published, else which one was not."""
    outside = np.flatnonzero(~np.isin(given, published))
    if not outside.size:
        return ""
    i = int(outside[0])
    more = f" ({outside.size} ids in all)" if outside.size > 1 else ""
    return f"block id {int(given[i])} at position {i} was not published{more}"


def _reason(exc: KvxferError) -> str:
    if isinstance(exc, PeerUnavailableError) and "data plane" in exc.message:
        return "data_plane"
    return exc.status.lower()


async def _first(a: asyncio.Future[Any], b: asyncio.Future[Any]) -> None:
    await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)


async def _gather_or_cancel(coros: list[Any]) -> None:
    """Run all; on the first failure cancel the rest and raise it."""
    if len(coros) == 1:
        await coros[0]
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for c in coros:
                tg.create_task(c)
    except BaseExceptionGroup as group:
        # Report the first real failure, not the group (the others were cancelled because of it).
        first = next((e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)), group.exceptions[0])
        raise first from None
