"""Push mode on the prefill side: layer-wise streams, and the prefills that end without publishing.

In push mode the decode instance offers its blocks for the proxy's push id before the prefill runs,
and the prefill side writes into them. With ``push_layerwise`` it does so while the prefill computes:
:class:`StreamedPrompts` follows each streamed prompt's block tables as vLLM schedules it and says
each step's part (:class:`~.plan.StreamSpec`, which the workers announce to their sidecars). A
push-mode prefill that ends without publishing has its offers ended now (:func:`abort_unpublished`),
not at their deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvxfer.client import Client
from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.params import ParamsError, push_id, wants_push
from kvxfer.integrations.vllm.plan import NULL_BLOCK, StreamSpec
from kvxfer.logs import get_logger

__all__ = ["StreamedPrompts", "abort_unpublished"]

# The scheduler's logger: these lines are the scheduler side's, as they were before this module was split from it.
log = get_logger("kvxfer.vllm.scheduler")


class StreamedPrompts:
    """Layer-wise push: each streamed prefill's block table so far, per transfer group."""

    def __init__(self, groups: Sequence[TransferGroup]) -> None:
        self.groups = tuple(groups)
        #: vLLM id -> (push id, prompt tokens, block table so far per group, the reader engine).
        self._streams: dict[str, tuple[str, int, list[list[int]], str]] = {}

    def start(self, request_id: str, pid: str, prompt_tokens: int, reader: str = "") -> None:
        """Stream this push-mode prefill (published under push id ``pid``, for decode engine ``reader``
        when the proxy named one) from its first step."""
        self._streams[request_id] = (pid, prompt_tokens, [[] for _ in self.groups], reader)

    def forget(self, request_id: str) -> None:
        """The request finished: nothing more of it streams."""
        self._streams.pop(request_id, None)

    def step(
        self, scheduled: Sequence[tuple[str, Sequence[Sequence[int]] | None, int, int, bool]]
    ) -> Iterator[StreamSpec]:  # fmt: skip
        """This step's part of every streamed prefill, in ``scheduled``'s order.

        ``scheduled``: as :meth:`~kvxfer.integrations.vllm.scheduler.SchedulerSide.step_streams` takes it.
        """
        for rid, new_blocks, computed, count, replace in scheduled:
            stream = self._streams.get(rid)
            if stream is None or count <= 0:
                continue
            pid, prompt, tables, reader = stream
            for table, more in zip(tables, new_blocks or [[] for _ in tables], strict=True):
                if replace:
                    table.clear()
                table.extend(more)
            end = min(computed + count, prompt)
            if end <= computed:
                continue
            groups = []
            for g, table in zip(self.groups, tables, strict=True):
                first = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
                groups.append((tuple(table[first:]), first * g.block_size))
            yield StreamSpec(pid, tuple(groups), computed, end, reader)
            if end >= prompt:
                del self._streams[rid]  # its last step: the publish follows


def abort_unpublished(request: Any, sidecars: Callable[[], Sequence[Client]]) -> None:
    """A push-mode prefill ended without publishing (aborted, failed, nothing to publish): every rank's
    sidecar is told (``Abort``; not waited for), so that the decode side's offers for its id fail now
    (their readers hear ``Landed`` with ABORTED) instead of waiting for their deadline."""
    params = request.kv_transfer_params
    if not wants_push(params):
        return
    try:
        pid = push_id(params)
    except ParamsError:
        return  # no decode side can have offered for an id that is not one
    status = getattr(request.status, "name", str(request.status))
    why = f"the prefill request {request.request_id} ended ({status}) without publishing its KV"
    rid = request.request_id

    def done(fut: cf.Future[tuple[int, bool]]) -> None:
        if not fut.cancelled() and fut.exception() is not None:  # the offers' deadline still ends them
            log.warning(f"request {rid}: could not tell the sidecar that push {pid} will not be published: "
                        f"{fut.exception()}")  # fmt: skip

    for c in sidecars():
        c.submit(c.aio.abort(pid, why)).add_done_callback(done)
