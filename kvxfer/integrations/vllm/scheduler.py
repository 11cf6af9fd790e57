"""The scheduler side of the vLLM connector, free of vLLM imports.

Prefill instance: when a request that the proxy marked ``do_remote_decode`` finishes, its blocks
already hold the prompt's KV in memory the sidecars registered, so the scheduler publishes them
on every rank's sidecar right away (before the response leaves the engine: a decode pull can
never arrive first), keeps them allocated, and answers the proxy with the params a decode
instance needs. The workers report the release (decode confirmed, lease expired, aborted) and
vLLM frees the blocks then.

Decode instance: a request with ``do_remote_prefill`` waits for its prompt's KV: the scheduler
asks vLLM for blocks, and the workers pull the prefill instance's published blocks into them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

from kvxfer.client import Client, KvxferRpcError
from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.params import (
    ParamsError,
    RemotePrefill,
    prefill_response,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvxfer.integrations.vllm.plan import GROUP, PullSpec, StepPlan
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.logs import get_logger, log_context

__all__ = ["SchedulerSide"]

log = get_logger("kvxfer.vllm.scheduler")

#: vLLM request statuses after which a prefill's KV is complete and worth handing over.
_DONE = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})


class SchedulerSide:
    """Book-keeping of one vLLM engine's scheduler, and publishing on its ranks' sidecars."""

    def __init__(
        self, settings: ConnectorSettings, *, engine_id: str, block_size: int, tp_size: int = 1, pp_size: int = 1,
        dp_rank: int = 0,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.dp_rank = dp_rank
        self._clients: list[Client] | None = None
        self._addresses: list[str] = []
        self._sidecar_engine = ""
        self._plan = StepPlan()
        self._loading: set[str] = set()  # decode requests whose KV is on its way

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
                raise KvxferError(f"sidecar of rank {missing[0]} has no KV caches registered", field="sidecar_socket")
            self._addresses = [s["peer_address"] for s in status]
            engines = {s["engine_id"] for s in status}
            self._sidecar_engine = engines.pop() if len(engines) == 1 else ""
        return self._addresses, self._sidecar_engine

    # ------------------------------------------------------------------ decode side
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the prefill instance computed beyond ``num_computed_tokens``, loaded asynchronously."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        try:
            remote = RemotePrefill.parse(params)
        except ParamsError as exc:
            log.warning("unusable kv_transfer_params; computing the prompt here",
                        extra={"request_id": request.request_id, "error": exc.message})  # fmt: skip
            return 0, False
        total = _tokens_to_load(request, remote)
        if remote.block_size and remote.block_size != self.block_size:
            # Whole pages move as they are; cutting them to another block size is not done here
            # (vLLM's CPU kernel keeps a head's K rows before its V rows inside a page).
            log.warning(
                "the prefill instance uses another block size; computing the prompt here",
                extra={"request_id": request.request_id, "remote": remote.block_size, "local": self.block_size},
            )
            return 0, False
        if len(remote.block_ids) * self.block_size < total:
            log.warning(
                "the prefill side published too few blocks for the prompt; computing it here",
                extra={"request_id": request.request_id, "published": len(remote.block_ids), "tokens": total},
            )
            return 0, False
        count = total - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Queue the pull of a decode request's prompt KV into the blocks vLLM just gave it."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        # One transfer per request: vLLM may call this again when it allocates more blocks.
        params["do_remote_prefill"] = False
        rid = request.request_id
        if num_external_tokens <= 0:
            # Nothing to load (the local prefix cache covered the prompt, or it is computed here):
            # tell the prefill side, so that it frees its copy now rather than at lease expiry.
            with contextlib.suppress(ParamsError):  # no usable addresses: the lease frees it
                self._plan.drops.append(RemotePrefill.parse(params))
            log.info("remote KV not needed; the prefill side frees its copy", extra={"request_id": rid})
            return
        try:
            remote: RemotePrefill | None = RemotePrefill.parse(params)  # checked in matched_tokens already
            error = ""
        except ParamsError as exc:
            remote, error = None, exc.message
        total = _tokens_to_load(request, remote)
        first = (total - num_external_tokens) // self.block_size  # blocks the local prefix cache covers
        last = math.ceil(total / self.block_size)
        local = tuple(block_ids[first:last])
        spec = PullSpec(rid, remote, local, remote.block_ids[first:last] if remote else (), error)
        if len(spec.remote_blocks) != len(local) and not spec.error:
            why = f"{len(local)} local blocks for {len(spec.remote_blocks)} remote ones"
            spec = PullSpec(rid, spec.remote, local, (), why)
        self._plan.pulls.append(spec)
        self._loading.add(rid)

    def loads_finished(self, request_ids: Sequence[str] | set[str] | None) -> None:
        """The workers reported these loads as ended."""
        self._loading.difference_update(request_ids or ())

    # ------------------------------------------------------------------ both sides
    def build_plan(self) -> StepPlan:
        """This step's work for the workers (and a fresh plan for the next step)."""
        plan, self._plan = self._plan, StepPlan()
        return plan

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until the workers report them sent, params for the proxy)."""
        params = request.kv_transfer_params
        rid = request.request_id
        if rid in self._loading:
            # Finished (aborted) while its KV is still arriving: stop the pull; vLLM keeps the
            # blocks until the workers report the load as ended.
            self._loading.discard(rid)
            self._plan.aborts.append(rid)
            return False, None
        if not wants_remote_decode(params):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if status not in _DONE or not block_ids:
            return False, None
        with log_context(request_id=rid):
            try:
                return True, self._publish(request, list(block_ids))
            except KvxferError as exc:
                log.error("publish failed; the decode side computes the prompt", extra={"error": exc.message})
                return False, None

    def _publish(self, request: Any, block_ids: list[int]) -> dict[str, Any]:
        rid = request.request_id
        addresses, engine = self._peer_identity()
        done: list[Client] = []
        expires: list[int] = []
        try:
            for c in self._sidecars():
                expires.append(c.publish(rid, {GROUP: block_ids}, lease_seconds=self.settings.lease_seconds))
                done.append(c)
        except KvxferRpcError:
            for c in done:
                try:
                    c.release(rid)
                except KvxferRpcError as exc:
                    log.warning("release after a failed publish failed", extra={"error": exc.details})
            self._addresses = []  # a sidecar restarted: ask again next time
            raise
        self._plan.published[rid] = min(expires)
        return prefill_response(
            engine_id=self.engine_id, request_id=rid, block_ids=block_ids, num_tokens=int(request.num_computed_tokens),
            block_size=self.block_size, addresses=addresses, sidecar_engine_id=engine, tp_size=self.tp_size,
            pp_size=self.pp_size,
        )  # fmt: skip

    def close(self) -> None:
        """Close the sidecar channels."""
        for c in self._clients or ():
            c.close()


def _tokens_to_load(request: Any, remote: RemotePrefill | None) -> int:
    """Prompt tokens whose KV the prefill side holds (all of them, unless it says fewer)."""
    prompt = len(request.prompt_token_ids or ())
    return min(remote.num_tokens or prompt, prompt) if remote else prompt
