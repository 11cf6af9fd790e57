"""The worker side of the vLLM connector, free of vLLM: one rank's caches, pulls and releases.

vLLM calls the worker side from its model-runner thread and expects every call to return at
once. All sidecar calls therefore run on the blocking client's event-loop thread
(:class:`kvxfer.client.Client`, started with :meth:`~kvxfer.client.Client.submit`);
the runner thread only starts them and, once per step, collects what finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import grpc

from kvxfer.client import Client, KvxferRpcError, PullResult
from kvxfer.client.gather import WorkerGather
from kvxfer.errors import InvalidArgumentError, KvxferError, Reason
from kvxfer.integrations.vllm.kvcache import SharedCaches, own_caches, share_caches
from kvxfer.integrations.vllm.layerwise import LayerwisePush
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.plan import PullSpec, StepPlan, pull_arguments, stage_addresses
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import CacheGroup
from kvxfer.integrations.vllm.unsettled import UnsettledLoads
from kvxfer.logs import get_logger, log_context
from kvxfer.memory import LibraryRef
from kvxfer.topology import RankInfo
from kvxfer.worker_agent import WorkerAgent

__all__ = ["SidecarUnavailableError", "WorkerSide"]

log = get_logger("kvxfer.vllm.worker")
T = TypeVar("T")

#: A published request whose release did not arrive this long after the lease Publish answered is
#: looked up at the sidecar (its stream may have been lost, or the sidecar restarted): it is handed
#: back to vLLM only if the sidecar no longer holds it. A decode instance that keeps the request
#: queued extends the lease (Holds, lookups), so the first answer's end proves nothing.
RELEASE_GRACE_SECONDS = 10.0
#: Least time between two such look-ups (each is a call to the sidecar from vLLM's step).
LEASE_CHECK_SECONDS = 1.0
#: Publishes asked about in one such look-up (GetStatus takes at most 1024); the rest wait for the next.
LEASE_CHECK_BATCH = 1024
#: Deadline of that look-up: a local call made from vLLM's step, which must not wait long for it.
LEASE_CHECK_DEADLINE_S = 1.0
#: Longest wait between two look-ups the sidecar did not answer (they back off from LEASE_CHECK_SECONDS).
LEASE_CHECK_MAX_SECONDS = 30.0
#: Longest wait between two attempts to reach a sidecar that went away.
RECONNECT_MAX_S = 10.0
#: Completion events for ids this worker never saw published are forgotten after this long.
EVENT_MEMORY_SECONDS = 300.0
_RELEASE_KINDS = frozenset({"RELEASED", "EXPIRED", "ABORTED"})


class SidecarUnavailableError(KvxferError):
    """The worker's sidecar cannot be reached; the message names its address."""

    status = "UNAVAILABLE"
    default_reason = Reason.SIDECAR_UNREACHABLE


class WorkerSide:
    """One worker rank: registers its caches with its sidecar, runs pulls, reports what finished.

    ``failure_policy`` is vLLM's ``kv_load_failure_policy`` (what vLLM does with a failed load);
    it only changes what the logs say.
    """

    def __init__(
        self, settings: ConnectorSettings, *, rank: RankInfo, local_rank: int, dp_rank: int = 0,
        worker_id: str = "", failure_policy: str = "fail", block_errors: bool = False,
    ) -> None:  # fmt: skip
        self.settings = settings
        #: Report a failed load as its blocks (vLLM recomputes from the first) rather than as the
        #: request: see :func:`~kvxfer.integrations.vllm.spec.reports_failed_blocks`.
        self.block_errors = block_errors
        self.rank = rank
        self.worker_id = worker_id or f"rank{local_rank}"
        self.failure_policy = failure_policy
        self.target = settings.socket_for(rank=local_rank, tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, dp_rank=dp_rank)
        self.sidecar = Client(self.target, token=settings.token(), timeout=settings.call_timeout_seconds)
        self.shared: SharedCaches | None = None
        self.registration: dict[str, Any] = {}
        self._names: dict[int, list[str]] = {}  # vLLM transfer group -> kvxfer groups
        #: Layer-wise push: the step that streams, and its layers' signals.
        self._layerwise = LayerwisePush(self.sidecar, lambda group: self._names.get(group, ()))
        self._lock = threading.Lock()
        self._pulls: dict[str, tuple[PullSpec, cf.Future[PullResult]]] = {}
        #: Loads that failed while a READ of them may still land (reason DATA_PLANE_UNFENCED): reported to
        #: vLLM only once the sidecar no longer names them unsettled, so their blocks are not reused before.
        self._unsettled = UnsettledLoads(
            self._still_unsettled, target=self.target, batch=LEASE_CHECK_BATCH, backoff_s=LEASE_CHECK_SECONDS,
            backoff_max_s=LEASE_CHECK_MAX_SECONDS,
        )  # fmt: skip
        self._aborting: set[str] = set()
        self._published: dict[str, int] = {}
        self._publish_ids: dict[str, str] = {}  # vLLM request id -> the id it was published under (push mode)
        self._released: dict[str, float] = {}
        self._next_lease_check = 0.0  # time.monotonic() of the next look-up of late publishes
        self._lease_check_failures = 0  # look-ups in a row the sidecar did not answer
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        self._watcher: cf.Future[None] | None = None
        #: data_plane "worker": this process's own agent, and its job loop on the client's thread.
        self.agent: WorkerAgent | None = None
        #: ``gather: worker`` with GPU caches: this process launches its same-host pulls' gathers.
        self.gather: WorkerGather | None = None
        self._agent_serving: cf.Future[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ registration
    def register(self, groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]) -> dict[str, Any]:
        """Share the described groups' memory with the sidecar and register them; returns its answer."""
        self._wait_for_sidecar()
        if self.settings.data_plane == "worker":
            self.shared = own_caches(groups, kv_caches)
            if self.agent is None:
                self.agent = WorkerAgent(self.settings.worker_backend)
                for g in groups:
                    ref = self.shared.memory[g.name]
                    assert isinstance(ref, LibraryRef)
                    self.agent.register_addresses(g.layout, ref)
        else:
            self.shared = share_caches(groups, kv_caches)
            self.gather = self._worker_gather(groups, kv_caches)
        self._names = {}
        for g in groups:
            self._names.setdefault(g.transfer_index, []).append(g.name)
        self._layerwise.register(groups, kv_caches, events=self.settings.push_layerwise)
        self.registration = self.sidecar.call(self._register(), timeout=self.settings.call_timeout_seconds + 5)
        for g in groups:
            lay = g.layout
            log.info(
                f"KV cache group {g.name} registered with the sidecar {self.target}: {lay.kind} {lay.dtype} "
                f"{lay.stride_order} (packing {lay.packing}), {lay.num_layers} layers x {lay.num_blocks} blocks of "
                f"{lay.block_size} tokens "
                f"({lay.page_bytes} bytes per page), moved by {self.shared.how}"
            )
        self._watcher = self.sidecar.submit(self._watch())
        if self.agent is not None and self._agent_serving is None:
            self._agent_serving = self.sidecar.submit(self.agent.serve(self.sidecar.aio))
        return self.registration

    def _worker_gather(self, groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]) -> WorkerGather | None:
        """With ``gather: worker`` and GPU caches: what runs the gathers the sidecar hands this worker."""
        if self.settings.gather != "worker":
            return None
        first = kv_caches[groups[0].layer_names[0]]
        if not first.is_cuda:
            log.info("gather: 'worker' applies to GPU caches; this worker's are in host memory, the sidecar moves them")
            return None
        # The regions in the order they are registered: groups in order, each group's regions in order.
        return WorkerGather(int(first.device.index or 0), [a for g in groups for a in g.region_addresses])

    async def _register(self) -> dict[str, Any]:
        assert self.shared is not None
        shared = self.shared
        # Handing descriptors over is a blocking socket exchange: keep it off the loop.
        refs = await asyncio.to_thread(shared.refs, self.target, token=self.settings.token())
        groups = {g.name: (g.layout, refs[g.name]) for g in shared.groups}
        lease = shared.lease.handle if shared.lease is not None else ""
        return await self.sidecar.aio.register_caches(
            groups, rank=self.rank, worker_id=self.worker_id, worker_lease=lease,
            worker_agent=self.agent.info() if self.agent is not None else None,
        )  # fmt: skip

    def _wait_for_sidecar(self) -> None:
        within = self.settings.startup_timeout_seconds
        try:
            self.sidecar.call(self.sidecar.aio.wait_ready(within), timeout=within + 5)
        except (KvxferRpcError, cf.TimeoutError) as exc:
            raise SidecarUnavailableError(
                f"sidecar_socket: no kvxfer sidecar answers at {self.target} after {within:g}s ({exc}); start "
                "`kvxfer serve --local-socket ...` next to this worker, one per rank",
                field="sidecar_socket",
            ) from None

    # ------------------------------------------------------------------ completions (prefill side)
    async def _watch(self) -> None:
        """Follow the completion stream; re-register after a sidecar restart."""
        after, instance = 0, self.registration.get("instance_id", "")
        failures = 0  # consecutive failed reconnects: the wait doubles from 0.5 s to RECONNECT_MAX_S
        while not self._closed:
            try:
                async for ev in self.sidecar.aio.watch_completions(replay=True, after=after):
                    after, failures = ev.sequence, 0
                    if ev.kind in _RELEASE_KINDS:
                        with self._lock:
                            self._released[ev.request_id] = time.monotonic()
            except KvxferRpcError as exc:
                if not failures:
                    log.warning(f"completion stream of the sidecar {self.target} lost: {exc.details}")
            if self._closed:
                return
            await asyncio.sleep(min(0.5 * 2**failures, RECONNECT_MAX_S))
            try:
                st = await self.sidecar.aio.status(deadline=2.0)
                if st["instance_id"] != instance or not st["registered"]:
                    log.warning(f"the sidecar {self.target} restarted; registering the caches again")
                    self.registration = await self._register()
                    after, instance = 0, self.registration["instance_id"]
                failures = 0
            except KvxferError as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:  # a down sidecar is said once, then now and then
                    log.warning(f"the sidecar {self.target} is unreachable ({failures} attempts): {exc.message}")

    # ------------------------------------------------------------------ per step
    def bind_step(self, plan: StepPlan) -> None:
        """The step's plan, before its forward pass (vLLM's ``bind_connector_metadata``).

        Announces its layer-wise streams: see :meth:`.LayerwisePush.bind_step`.
        """
        self._layerwise.bind_step(plan)

    def on_step(self, plan: StepPlan) -> None:
        """Start this step's pulls and aborts; remember what the prefill side published.

        vLLM calls it (``start_load_kv``) after the step's forward pass; the step's layer-wise
        streams were announced before it (:meth:`bind_step`).
        """
        with self._lock:
            self._published.update(plan.published)
            self._publish_ids.update(plan.publish_ids)
        for spec in plan.pulls:
            if spec.request_id in self._pulls:
                log.warning(f"request {spec.request_id}: a pull is already running")
                continue
            self._pulls[spec.request_id] = (spec, self.sidecar.submit(self._pull(spec)))
        for rid in plan.aborts:
            running = self._pulls.get(rid)
            if running is None or running[1].done():
                if running is not None or rid in self._unsettled:
                    # Its load ended but is not reported yet (kept while a READ may land): vLLM frees the
                    # blocks once it is, so they are not named as failed (:meth:`_load_ended`).
                    self._aborting.add(rid)
                continue
            self._aborting.add(rid)
            self.sidecar.submit(self._abort(running[0]))
        if self.rank.tp_rank == 0:  # one rank per pipeline stage tells that stage's prefill ranks
            for remote in plan.drops:
                self.sidecar.submit(self._drop(remote))

    def layer_saved(self, layer_name: str) -> None:
        """A layer's KV of this step is in the cache: its WRITEs may start (:meth:`.LayerwisePush.layer_saved`)."""
        self._layerwise.layer_saved(layer_name)

    def step_saved(self) -> None:
        """The step's forward pass ended: no more layer signals until the next streamed step."""
        self._layerwise.step_saved()

    @property
    def layer_signals(self) -> int:
        """Layer signals given so far (layer-wise push)."""
        return self._layerwise.signals

    @property
    def layer_signal_seconds(self) -> float:
        """What those signals cost the forward pass, in seconds."""
        return self._layerwise.signal_seconds

    async def _pull(self, spec: PullSpec) -> PullResult:
        remote = spec.remote
        if remote is None or spec.error:
            raise InvalidArgumentError(f"cannot load the KV of {spec.request_id!r}: {spec.error}",
                                       field="kv_transfer_params")  # fmt: skip
        args = pull_arguments(spec, lambda group: self._names.get(group, ()))
        with log_context(request_id=spec.request_id, peer=remote.sidecar_engine_id or remote.engine_id or None):
            addresses = self._stage_addresses(remote.addresses)
            return await self.sidecar.aio.pull(
                remote.request_id, addresses, args.local_blocks, remote_blocks=args.remote_blocks, spans=args.spans,
                remote_engine_id=remote.sidecar_engine_id, wait=True,
                deadline=self.settings.transfer_timeout_seconds or None, push=spec.push, gather=self.gather,
            )  # fmt: skip

    def _stage_addresses(self, addresses: tuple[str, ...]) -> list[str]:
        return stage_addresses(addresses, self.rank.pp_rank, self.rank.pp_size)

    async def _drop(self, remote: RemotePrefill) -> None:
        try:
            addresses = self._stage_addresses(remote.addresses)
            await self.sidecar.aio.drop_remote(remote.request_id, addresses, "the decode instance needs none of its KV")
        except KvxferError as exc:  # the lease still frees it
            log.warning(f"request {remote.request_id}: could not ask the prefill side to free it: {exc.message}")

    async def _abort(self, spec: PullSpec) -> None:
        if spec.remote is None:
            return
        try:
            await self.sidecar.aio.abort(spec.remote.request_id, "the vLLM request finished before its KV arrived")
        except KvxferRpcError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                log.warning(f"request {spec.request_id}: abort failed: {exc.details}")

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(requests whose published blocks vLLM may free, requests whose loads ended, those that failed).

        A load that failed still ends. Where vLLM may recompute from the first failed block
        (``block_errors``) its blocks are reported by :meth:`load_errors`; otherwise, and for a load
        that named no block (it could not even start), the request is reported (``failed``).
        """
        recving: set[str] = set()
        failed: set[str] = set()
        for rid, (spec, fut) in list(self._pulls.items()):
            if not fut.done():
                continue
            del self._pulls[rid]
            exc = fut.exception()
            if isinstance(exc, KvxferError) and exc.reason == Reason.DATA_PLANE_UNFENCED and spec.remote is not None:
                # Its bytes may still land: vLLM must not recompute into these blocks or free them yet.
                log.warning(f"request {rid}: KV load failed while a READ of it may still land ({exc}); its blocks "
                            "are kept until the sidecar says the READ ended")  # fmt: skip
                self._unsettled.keep(rid, spec, exc)
                continue
            if exc is None:
                res = fut.result()
                log.debug(f"request {rid}: KV loaded, {res.bytes} bytes in {res.descriptors} descriptors")
            self._load_ended(rid, spec, exc, recving, failed)
        for rid, spec, exc in self._unsettled.take_settled(self.agent):
            self._load_ended(rid, spec, exc, recving, failed)
        sending: set[str] = set()
        now, wall_ms = time.monotonic(), time.time() * 1000
        with self._lock:
            late = {rid: self._publish_ids.get(rid, rid) for rid, expires_ms in self._published.items()
                    if wall_ms > expires_ms + RELEASE_GRACE_SECONDS * 1000}  # fmt: skip
            late = dict(list(late.items())[:LEASE_CHECK_BATCH])
        held = self._still_held(set(late.values()), now) if late else None
        asked = set(late) if held is not None else set()
        with self._lock:
            for rid in list(self._published):
                pid = self._publish_ids.get(rid, rid)
                gone = rid in asked and pid not in (held or {})
                if rid in asked and not gone:
                    self._published[rid] = (held or {})[pid]  # a decode request keeps it held: wait on
                if pid in self._released or gone:
                    sending.add(rid)
                    del self._published[rid]
                    self._publish_ids.pop(rid, None)
                    self._released.pop(pid, None)
                    if gone:
                        log.warning(f"request {rid}: no release heard from the sidecar, which no longer holds it; "
                                    "freeing its blocks")  # fmt: skip
            for rid, at in list(self._released.items()):
                if now - at > EVENT_MEMORY_SECONDS:
                    del self._released[rid]
        return sending, recving, failed

    def _load_ended(
        self, rid: str, spec: PullSpec, exc: BaseException | None, recving: set[str], failed: set[str]
    ) -> None:  # fmt: skip
        """Report a load that ended: to ``recving``, and if it failed as vLLM's policy wants it."""
        recving.add(rid)
        aborted = rid in self._aborting
        self._aborting.discard(rid)
        if exc is not None and not aborted:
            # An aborted request's blocks are freed by vLLM; naming them would mark blocks that
            # may already belong to another request.
            if self.block_errors and spec.local_blocks:
                self._errors.update(spec.local_blocks)
            else:
                failed.add(rid)
            then = "fails the request" if self.failure_policy == "fail" else "recomputes the prompt"
            log.warning(f"request {rid}: KV load failed ({exc}); vLLM {then} (kv_load_failure_policy="
                        f"{self.failure_policy})")  # fmt: skip

    def _still_unsettled(self, pull_ids: list[str]) -> set[str]:
        """Of these pulls (ids as pulled), those the sidecar still names unsettled (:mod:`.unsettled`)."""
        status = self.sidecar.status(unsettled=pull_ids, deadline=LEASE_CHECK_DEADLINE_S)
        return set(status["unsettled"])

    def _still_held(self, publish_ids: set[str], now: float) -> dict[str, int] | None:
        """Which of these publishes the sidecar still holds, by id, and when each lease ends (Unix ms).

        None when not asked (once per :data:`LEASE_CHECK_SECONDS`) or the sidecar did not answer: the
        blocks stay with the publish, since a reader may hold a grant on them that this worker cannot see.
        """
        if now < self._next_lease_check:
            return None
        try:
            status = self.sidecar.status(publishes=sorted(publish_ids), deadline=LEASE_CHECK_DEADLINE_S)
        except (KvxferError, TimeoutError) as exc:
            # Timed from the answer, and backing off: a sidecar that does not answer must not cost
            # every engine step a second.
            self._lease_check_failures += 1
            wait = min(LEASE_CHECK_SECONDS * 2**self._lease_check_failures, LEASE_CHECK_MAX_SECONDS)
            self._next_lease_check = time.monotonic() + wait
            log.warning(f"could not ask the sidecar {self.target} whether it still holds {len(publish_ids)} "
                        f"publishes whose release was not heard; their blocks stay held (next try in {wait:g} s): "
                        f"{exc}")  # fmt: skip
            return None
        self._lease_check_failures = 0
        self._next_lease_check = time.monotonic() + LEASE_CHECK_SECONDS
        held: dict[str, int] = status["publishes"]
        return held

    def load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call (with ``block_errors`` only)."""
        out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        """Close the client; let the sidecar forget the memory (tensors keep their mapping)."""
        if self._layerwise.signals:
            self._layerwise.log_signals()
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._agent_serving is not None:
            self._agent_serving.cancel()
        if self.agent is not None:
            # On the loop its transfers run on, and before the client goes: the cancelled ones end (fenced)
            # before the agent deregisters the memory.
            try:
                self.sidecar.call(self.agent.aclose(), timeout=self.agent.transport.config.fence_budget_s + 2.0)
            except Exception as exc:  # closing anyway: the process is going away
                log.warning(f"the worker's data-plane agent did not close cleanly: {exc!r}")
                self.agent.close()
        self.sidecar.close()
        if self.gather is not None:
            self.gather.close()  # unmaps the publishers' memory this process opened
        if self.shared is not None:
            self.shared.close()
