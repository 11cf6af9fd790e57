"""The asynchronous client of one sidecar's local API (gRPC, and the fast socket for the hot calls)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message

from kvxfer.client.fast import decode_answer, lost_error, timeout_error
from kvxfer.client.gather import GatherOutcome, WorkerGather, report_lost, settled
from kvxfer.client.quiet import QuietCalls
from kvxfer.client.types import (
    BlockMap,
    CompletionEvent,
    GroupsArg,
    KvxferRpcError,
    PullItem,
    PullResult,
    TokenSpan,
    _batch_results,
    _check_timeout,
    _event,
    _groups_proto,
    _options,
    _publish_request,
    _pull_request,
    _pull_result,
    _status_dict,
    normalize_target,
)
from kvxfer.errors import Reason
from kvxfer.fastsock import FastCallError, FastChannel, FastHelloRefusedError
from kvxfer.logs import get_logger
from kvxfer.topology import RankInfo
from kvxfer.transport.base import DEFAULT_FENCE_BUDGET_S, WorkerAgentInfo
from kvxfer.wire import local_pb2, local_pb2_grpc
from kvxfer.wire.convert import (
    rank_to_proto,
    worker_agent_to_proto,
)
from kvxfer.wire.frames import METHOD_OF_REQUEST, FastMethod, fast_socket_path
from kvxfer.wire.status import error_from_status_message

__all__ = ["AsyncClient"]

Q = TypeVar("Q", bound=Message)
R = TypeVar("R")

#: After the fast socket could not be reached, hot calls use gRPC this long before trying it again.
FAST_RETRY_SECONDS = 5.0

log = get_logger("kvxfer.client")


class AsyncClient(QuietCalls):
    """Client of one sidecar's local API (bound to the event loop that first uses it).

    grpc.aio for every call; with ``fast`` (the default) and a Unix-socket target, ``pull``,
    ``pull_batch`` and ``publish`` go over the sidecar's fast socket while it can be reached
    (:attr:`fast_active`), with the same deadline, token and errors. The quiet calls
    (:meth:`expect_quietly`) come from :class:`~kvxfer.client.quiet.QuietCalls`.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        fast: bool = True,
    ) -> None:
        self.target = normalize_target(target)
        self.timeout = _check_timeout(timeout)
        #: How long after its deadline a failed pull's answer may come (the sidecar fences its READs
        #: first): the sidecar's --fence-budget-seconds, learnt at register_caches (its default until then).
        self.fence_budget = DEFAULT_FENCE_BUDGET_S
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self._token = token
        self._max_message_bytes = max_message_bytes
        # The fast socket sits beside a Unix-socket target only (a TCP --local-listen has none).
        self.fast_socket = fast_socket_path(self.target) if fast and self.target.startswith("unix://") else None
        self._fast: FastChannel | None = None
        self._fast_retry_at = 0.0
        self._fast_refused: set[int] = set()  # fast-socket methods the sidecar does not serve (an older one)
        self._fast_connecting: asyncio.Lock | None = None
        opts = _options(max_message_bytes)
        self._channel = (
            grpc.aio.secure_channel(self.target, credentials, options=opts)
            if credentials is not None
            else grpc.aio.insecure_channel(self.target, options=opts)
        )
        self._stub = local_pb2_grpc.LocalStub(self._channel)
        self._reports: set[asyncio.Task[Any]] = set()  # GatherDone (and Expect) sent in the background
        #: Quiet calls (:meth:`expect_quietly`) that failed, and the last such failure.
        self.quiet_failures = 0
        self.last_quiet_failure: KvxferRpcError | None = None

    async def _call(self, rpc: grpc.aio.UnaryUnaryMultiCallable[Q, R], req: Q, deadline: float | None) -> R:
        timeout = self.call_timeout(req, deadline)
        method = METHOD_OF_REQUEST.get(type(req)) if self.fast_socket is not None else None
        if method is not None and method.number not in self._fast_refused:
            channel = self._fast if self._fast is not None and not self._fast.closed else await self._fast_channel()
            if channel is not None:
                try:
                    return cast(R, await self._call_fast(channel, method, req, timeout))
                except FastCallError as exc:
                    if exc.sent:
                        raise lost_error(method, exc) from None
                    # Not sent: nothing started in the sidecar, so gRPC may carry it.
                except KvxferRpcError as exc:
                    if exc.code != grpc.StatusCode.UNIMPLEMENTED or exc.field != "method":
                        raise
                    # An older sidecar's fast socket lacks this method (e.g. Expect before stop 25): it
                    # refused the frame before running anything, so gRPC carries it, now and from now on.
                    self._fast_refused.add(method.number)
        try:
            return await rpc(req, timeout=timeout, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise KvxferRpcError.of_call(exc, type(req).DESCRIPTOR.name.removesuffix("Request")) from None

    def call_timeout(self, req: Message, deadline: float | None) -> float:
        """The seconds a call of ``req`` may take: ``deadline``, else the client's timeout; checked.

        ``deadline`` 0 is refused like any other that is no positive number of seconds (it used to
        mean the client's timeout).
        """
        timeout = self.timeout if deadline is None else deadline
        if not math.isfinite(timeout) or timeout <= 0:
            # gRPC would end such a call at once with DEADLINE_EXCEEDED, which reads like a slow sidecar.
            raise KvxferRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, f"deadline: must be a finite number of seconds > 0, got {deadline}",
                type(req).DESCRIPTOR.name.removesuffix("Request"), reason=Reason.INVALID_FIELD, field="deadline",
            )  # fmt: skip
        return timeout

    @property
    def fast_active(self) -> bool:
        """True while a connection to the sidecar's fast socket is open (hot calls use it)."""
        return self._fast is not None and not self._fast.closed

    async def _fast_channel(self) -> FastChannel | None:
        """The open fast-socket connection, connecting when due; None: use gRPC for now."""
        assert self.fast_socket is not None
        if time.monotonic() < self._fast_retry_at:
            return None
        if self._fast_connecting is None:
            self._fast_connecting = asyncio.Lock()
        async with self._fast_connecting:  # one connection attempt at a time
            if self._fast is not None and not self._fast.closed:
                return self._fast
            self._fast = None
            if time.monotonic() < self._fast_retry_at:
                return None
            try:
                self._fast = await FastChannel.open(
                    self.fast_socket, token=self._token, timeout=min(self.timeout, 2.0),
                    max_message_bytes=self._max_message_bytes,
                )  # fmt: skip
                self._fast.on_quiet_failure = self._quiet_failed
            except (OSError, TimeoutError) as exc:
                # No fast socket (an older sidecar, --fast-socket false, a directory the worker
                # cannot reach): gRPC serves every call, and the socket is tried again later.
                log.debug("fast socket unavailable; using gRPC", extra={"socket": str(self.fast_socket),
                                                                         "error": str(exc)})  # fmt: skip
                self._fast_retry_at = time.monotonic() + FAST_RETRY_SECONDS
            except FastHelloRefusedError as exc:
                # Refused (a wrong token): gRPC gets the same refusal, with its status, on every call.
                _, message, _, _ = error_from_status_message(exc.status)
                log.warning("the sidecar refused the fast socket; using gRPC", extra={"error": message})
                self._fast_retry_at = math.inf
            return self._fast

    async def _call_fast(self, channel: FastChannel, method: FastMethod, req: Message, timeout: float) -> Message:
        try:
            code, payload = await channel.call(method.number, req.SerializeToString(), timeout)
        except TimeoutError:
            raise timeout_error(method) from None
        return decode_answer(method, code, payload)

    async def register_caches(
        self, groups: GroupsArg, *, rank: RankInfo | None = None, worker_id: str = "", deadline: float | None = None,
        worker_lease: str = "", worker_agent: WorkerAgentInfo | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Register cache groups; returns engine_id, instance_id, epoch, registered_bytes, backend, peer_address.

        ``worker_lease`` names a lease this process holds on the descriptor socket
        (:func:`kvxfer.fdpass.send_fds` with no descriptors): when it closes, the sidecar drops the
        registration. ``worker_agent`` is this process's own data-plane agent, for a sidecar that runs
        ``--backend worker`` (:class:`kvxfer.worker_agent.WorkerAgent`).
        """
        req = local_pb2.RegisterCachesRequest(
            worker_id=worker_id, rank=rank_to_proto(rank or RankInfo(0, 1)), groups=_groups_proto(groups),
            worker_lease=worker_lease,
        )  # fmt: skip
        if worker_agent is not None:
            req.worker_agent.CopyFrom(worker_agent_to_proto(worker_agent))
        resp = await self._call(self._stub.RegisterCaches, req, deadline)
        if resp.fence_budget_seconds > 0:  # 0: a sidecar from before the fence
            self.fence_budget = float(resp.fence_budget_seconds)
        return _status_dict(resp)

    async def publish(
        self, request_id: str, blocks: BlockMap, *, lease_seconds: float = 0.0, deadline: float | None = None,
        reader_engine_id: str = "", origins: Mapping[str, int] | None = None,
    ) -> int:  # fmt: skip
        """Publish a request's blocks; returns the lease's expiry (unix ms).

        ``reader_engine_id`` binds the publish to the decode engine meant to read it (else to the
        first reader engine that fetches it). ``origins``: per group, the request's token position
        of the first listed block (a sliding window's tail; push offers name token positions).
        """
        req = _publish_request(request_id, blocks, lease_seconds, reader_engine_id, origins)
        resp: local_pb2.PublishResponse = await self._call(self._stub.Publish, req, deadline)
        return int(resp.expires_unix_ms)

    async def pull(
        self, request_id: str, remote_addresses: Sequence[str], local_blocks: BlockMap, *,
        remote_blocks: BlockMap | None = None, remote_engine_id: str = "", wait: bool = True,
        deadline: float | None = None, spans: Mapping[str, TokenSpan] | None = None, push: bool = False,
        gather: WorkerGather | None = None,
    ) -> PullResult:  # fmt: skip
        """Pull a published request into ``local_blocks``; with ``wait`` returns once the bytes are in place.

        ``spans`` moves part of a group's tokens (:class:`TokenSpan`); it needs ``remote_blocks`` (but
        with ``push``). ``push``: the sources WRITE into ``local_blocks`` once the request is published
        there (push mode: the pull may start before the prefill does). ``gather``: this worker moves
        the bytes itself when the sidecar hands it the pull as one same-host GPU gather
        (:mod:`kvxfer.client.gather`): it launches in the loop's thread right after the answer, which
        polls the end for up to 2 ms; longer copies are waited for on a worker thread.
        """
        item = PullItem(request_id, remote_addresses, local_blocks, remote_blocks, remote_engine_id, wait, deadline,
                        spans, push)  # fmt: skip
        req = _pull_request(item)
        req.worker_gather = gather is not None and gather.usable
        t0 = time.perf_counter()
        answer = self._call(self._stub.Pull, req, self.pull_timeout(deadline))
        if gather is not None and req.worker_gather and gather.warm:
            # The call's first step sends the request; the loop's thread warms the gather's code
            # meanwhile (WorkerGather.warm_up) and then awaits the answer.
            call = asyncio.ensure_future(answer)
            try:
                await asyncio.sleep(0)
                gather.warm_up()
                resp = await call
            except BaseException:
                call.cancel()
                raise
        else:
            resp = await answer
        if resp.HasField("gather") and gather is not None:
            gather.last["answer"] = (time.perf_counter() - t0) * 1e6
            outcome = await gather.run_async(resp.gather)  # launched in this thread, right after the answer
            final = self.report_gather(resp, outcome, t0)
            if final is not None:
                return final
            return _pull_result(await self.gather_done(outcome.report(resp.gather.ticket), deadline))
        return _pull_result(resp)

    def report_gather(self, resp: local_pb2.PullResponse, outcome: GatherOutcome, t0: float) -> PullResult | None:
        """After this worker ran a pull's gather: the pull's result when the worker knows it now (a
        gather that ended in time; raises for a failed one), its report going in the
        background from this loop; else None: the caller awaits :meth:`gather_done`'s answer."""
        if not outcome.launched:  # the sidecar moves the bytes; its GatherDone answer is the outcome
            return None
        task = asyncio.get_running_loop().create_task(self.gather_done(outcome.report(resp.gather.ticket)))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)
        task.add_done_callback(report_lost)
        return settled(resp, outcome, t0)

    async def gather_done(
        self, report: local_pb2.GatherDoneRequest, deadline: float | None = None
    ) -> local_pb2.PullResponse:
        """Report how a gather this worker was handed ended; answers the pull's outcome."""
        return await self._call(self._stub.GatherDone, report, deadline)

    async def pull_batch(self, items: Sequence[PullItem]) -> list[PullResult | KvxferRpcError]:
        """Several pulls in one call (e.g. all a worker starts in one step), one result or error each, in order.

        Each pull runs and fails on its own, as with :meth:`pull`; the call returns once all have
        answered. It raises only when the batch itself is refused (empty, over 1024 pulls, no sidecar);
        an item whose arguments cannot be sent (spans without remote_blocks) gets its own error and
        the others go.
        """
        results: list[PullResult | KvxferRpcError | None] = [None] * len(items)
        sent: list[tuple[int, local_pb2.PullRequest]] = []
        for n, item in enumerate(items):
            try:
                sent.append((n, _pull_request(item, "PullBatch")))
            except KvxferRpcError as exc:
                results[n] = exc
        if sent or not items:  # an empty batch goes, for the sidecar to refuse
            req = local_pb2.PullBatchRequest(pulls=[r for _, r in sent])
            # The call lasts as long as its longest pull, plus a second.
            call_timeout = max((self.pull_timeout(items[n].deadline) for n, _ in sent), default=self.timeout + 1.0)
            answers = _batch_results(await self._call(self._stub.PullBatch, req, call_timeout))
            for (n, _), answer in zip(sent, answers, strict=True):
                results[n] = answer
        return [r for r in results if r is not None]

    def pull_timeout(self, deadline: float | None) -> float:
        """The call's timeout for a pull of ``deadline`` (its ``timeout_seconds``), plus the sidecar's
        fence budget and a second.

        A pull that fails at its deadline is answered only once the sidecar's data plane has fenced
        its READs (at most :attr:`fence_budget` later): a client that gave up sooner would let its
        worker reuse blocks a READ may still land in. A deadline that is no positive number of
        seconds never gets here: the request's making refuses it
        (:func:`~kvxfer.client.types._pull_request`).
        """
        if deadline is not None and math.isfinite(deadline) and deadline > 0:
            return deadline + self.fence_budget + 1.0
        return self.timeout + self.fence_budget + 1.0

    async def watch_completions(self, *, replay: bool = False, after: int = 0) -> AsyncGenerator[CompletionEvent, None]:
        """Completion events as they happen (no deadline: the stream lives as long as the caller wants)."""
        call = self._stub.WatchCompletions(
            local_pb2.WatchCompletionsRequest(replay=replay, after_sequence=after), metadata=self._md
        )
        try:
            async for ev in call:
                yield _event(ev)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise KvxferRpcError.of_call(exc, "WatchCompletions") from None
        finally:
            call.cancel()

    async def release(self, request_id: str, *, deadline: float | None = None) -> bool:
        """Drop a publish; False if nothing was held under that id."""
        resp: local_pb2.ReleaseResponse = await self._call(
            self._stub.Release, local_pb2.ReleaseRequest(request_id=request_id), deadline
        )
        return bool(resp.released)

    async def abort(self, request_id: str, reason: str = "", *, deadline: float | None = None) -> tuple[int, bool]:
        """Abort a request here and on its peers; returns (pulls aborted, publish aborted)."""
        resp: local_pb2.AbortResponse = await self._call(
            self._stub.Abort, local_pb2.AbortRequest(request_id=request_id, reason=reason), deadline
        )
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
        resp: local_pb2.AbortResponse = await self._call(self._stub.Abort, req, deadline)
        return int(resp.remote_dropped)

    async def expect(self, request_id: str, remote_addresses: Sequence[str], *, deadline: float | None = None) -> bool:
        """Keep a queued request's publishes alive until its pull starts (decode side; see ``Expect``).

        Returns False when the request was already expected.
        """
        req = local_pb2.ExpectRequest(request_id=request_id, remote_addresses=list(remote_addresses))
        resp: local_pb2.ExpectResponse = await self._call(self._stub.Expect, req, deadline)
        return bool(resp.held)

    async def prepare(
        self, request_id: str, remote_addresses: Sequence[str], local_blocks: BlockMap, *,
        remote_blocks: BlockMap | None = None, remote_engine_id: str = "", spans: Mapping[str, TokenSpan] | None = None,
        deadline: float | None = None,
    ) -> bool:  # fmt: skip
        """Hand the sidecar the pull a worker is about to make, to check and plan now (decode side; see ``Prepare``).

        The arguments are :meth:`pull`'s: the pull that follows with the same ones reads on this plan.
        Moves and holds nothing. True when planned; False when the pull will plan as usual (for
        instance without ``remote_blocks``); bad arguments raise as :meth:`pull` would.
        """
        item = PullItem(request_id, remote_addresses, local_blocks, remote_blocks, remote_engine_id, True, deadline,
                        spans, False)  # fmt: skip
        req = local_pb2.PrepareRequest(pull=_pull_request(item, "Prepare"))
        resp: local_pb2.PrepareResponse = await self._call(self._stub.Prepare, req, deadline)
        return bool(resp.prepared)

    async def drain(self, timeout_seconds: float = 0.0, *, deadline: float | None = None) -> dict[str, Any]:
        """Start the graceful drain and wait for it."""
        resp = await self._call(self._stub.Drain, local_pb2.DrainRequest(timeout_seconds=timeout_seconds), deadline)
        return _status_dict(resp)

    async def status(
        self, *, publishes: Sequence[str] = (), unsettled: Sequence[str] = (), deadline: float | None = None
    ) -> dict[str, Any]:
        """What the sidecar holds right now.

        ``publishes``: request ids (as published) to look for; the answer's ``publishes`` maps those
        still held to when their lease ends now (Unix ms, after every Hold and lookup that extended it).
        ``unsettled``: request ids (as pulled) of pulls that failed with reason ``DATA_PLANE_UNFENCED``;
        the answer's ``unsettled`` lists those whose READs may still land in their blocks (keep them).
        """
        req = local_pb2.GetStatusRequest(publishes=publishes, unsettled=unsettled)
        resp = await self._call(self._stub.GetStatus, req, deadline)
        out = _status_dict(resp)
        out["publishes"] = {p.request_id: int(p.expires_unix_ms) for p in resp.publishes}
        out["unsettled"] = list(resp.unsettled)
        return out

    async def agent_jobs(
        self, *, wait_seconds: float = 0.0, max_jobs: int = 0, epoch: int = 0
    ) -> list[local_pb2.AgentJob]:
        """The next jobs of this worker's data-plane agent (``--backend worker``; :mod:`kvxfer.worker_agent`)."""
        req = local_pb2.AgentJobsRequest(epoch=epoch, max_jobs=max_jobs, wait_seconds=wait_seconds)
        resp: local_pb2.AgentJobsResponse = await self._call(self._stub.AgentJobs, req, wait_seconds + self.timeout)
        return list(resp.jobs)

    async def agent_report(self, outcomes: Sequence[local_pb2.AgentOutcome]) -> None:
        """Outcomes of jobs this worker's agent ran."""
        await self._call(self._stub.AgentReport, local_pb2.AgentReportRequest(outcomes=outcomes), None)

    async def stream_step(
        self, step: int, requests: Sequence[local_pb2.StreamedRequest], events: Sequence[local_pb2.LayerEvent] = ()
    ) -> int:
        """Layer-wise push: the requests this engine step computes; returns how many are offered already.

        ``events``: a GPU worker's interprocess event per (group, layer), recorded after each layer.
        """
        req = local_pb2.StreamStepRequest(step=step, requests=requests, events=events)
        resp = await self._call(self._stub.StreamStep, req, None)
        return int(resp.offered)

    async def layer_done(self, step: int, group: str, layer: int) -> int:
        """Layer-wise push: one layer of ``step`` is computed; returns the WRITEs it started."""
        resp = await self._call(self._stub.LayerDone, local_pb2.LayerDoneRequest(step=step, group=group, layer=layer),
                                None)  # fmt: skip
        return int(resp.writes)

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
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Close the channel (and the fast socket's connection)."""
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        self._fast_retry_at = math.inf  # a call after close must not reconnect
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
