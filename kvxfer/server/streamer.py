"""Layer-wise push (the writer's side): WRITE each layer of an offered request as soon as it is computed.

The prefill worker says, once per engine step, which requests the step computes (their block
tables so far and the tokens the step adds: ``StreamStep``), then, after each attention layer,
that the layer's KV is in the cache (``LayerDone``, a frame on the fast socket the worker does not
wait for). For every request of the step that a decode rank has offered blocks for, that layer's
part of the step's tokens is written at once, while the next layers compute: the descriptors of
the offer's plan (:mod:`kvxfer.server.pusher`) for the step's tokens, restricted to the layer's
region. Writes of one layer of one offer run in step order, so a partly computed chunk written by
one step is overwritten by the next step's.

What a step wrote is recorded on the offer (per group and layer, how far its tokens are written).
An offer the stream covers completely (every group, every layer, every offered token) gets its
``Landed`` at once: the decode side starts without waiting for the prefill to finish its step and
publish; the publish, when it comes, counts that reader as done. Otherwise, when the request is
published, the pusher writes only the groups the stream did not cover completely (an offer that
came after the first layers, a layout whose layers share one region, a Mamba state), then reports
Landed as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidArgumentError, KvxferError
from kvxfer.logs import get_logger, log_context
from kvxfer.server.pusher import Offer, Pusher, token_span
from kvxfer.server.registration import Registry
from kvxfer.server.state import Registration
from kvxfer.wire import local_pb2
from kvxfer.wire.convert import blocks_from_proto, check_id, check_reader_engine_id

__all__ = ["Streamer"]

log = get_logger("kvxfer.server")
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
#: Steps remembered for late LayerDone frames (a step older than this is over).
MAX_STEPS = 64


@dataclass(frozen=True)
class _Streamed:
    """One request of a step: its blocks so far, their origins, and the tokens the step computes."""

    request_id: str
    blocks: dict[str, I64]
    origins: dict[str, int]
    start: int
    end: int
    reader: str = ""  # the engine its publish will be bound to ("": any)


class Streamer:
    """Owns the steps the worker announced and starts each layer's WRITEs (see the module docs)."""

    def __init__(self, registry: Registry, pusher: Pusher) -> None:
        self.registry = registry
        self.pusher = pusher
        self._steps: dict[int, list[_Streamed]] = {}
        #: Per step: the GPU worker's event of each (group, layer) (device, IPC handle), and the opened events.
        self._events: dict[int, dict[tuple[str, int], tuple[int, bytes]]] = {}
        self._opened: dict[tuple[int, bytes], int] = {}
        self._early: dict[int, list[tuple[str, int]]] = {}  # LayerDone frames that overtook their StreamStep
        #: (offer, step, group) -> (this side's rows, the reader's rows, this side's region of each row)
        self._rows: dict[tuple[str, int, str], tuple[U64, U64, I64]] = {}

    def step(self, req: local_pb2.StreamStepRequest) -> local_pb2.StreamStepResponse:
        """StreamStep: remember the step's requests (and run the layers that came first)."""
        reg = self.registry.require()
        step = int(req.step)
        reqs = []
        for i, r in enumerate(req.requests):
            rid = check_id(r.request_id, f"requests[{i}].request_id")
            if r.end_token <= r.start_token:
                raise InvalidArgumentError(
                    f"requests[{i}].end_token: {r.end_token} is not after start_token {r.start_token}",
                    field=f"requests[{i}].end_token",
                )  # fmt: skip
            blocks = blocks_from_proto(r.blocks, reg.layouts, f"requests[{i}].blocks")
            origins = {bl.group: int(bl.skip_tokens) for bl in r.blocks}
            reader = check_reader_engine_id(r.reader_engine_id, f"requests[{i}].reader_engine_id")
            reqs.append(_Streamed(rid, blocks, origins, int(r.start_token), int(r.end_token), reader))
        self._steps[step] = reqs
        self._events[step] = {(e.group, int(e.layer)): (int(e.device), bytes(e.ipc_handle)) for e in req.events}
        for old in [s for s in self._steps if s <= step - MAX_STEPS]:
            del self._steps[old]
            self._events.pop(old, None)
        self._rows = {k: v for k, v in self._rows.items() if k[1] > step - MAX_STEPS}
        for group, layer in self._early.pop(step, ()):
            self._layer(step, group, layer, reg)
        offered = sum(any(_streamable(r, o) for o in self.pusher.offers.get(r.request_id, {}).values()) for r in reqs)
        return local_pb2.StreamStepResponse(offered=offered)

    def layer_done(self, req: local_pb2.LayerDoneRequest) -> local_pb2.LayerDoneResponse:
        """LayerDone: WRITE this layer of every offered request of the step."""
        reg = self.registry.require()
        group, layer, step = req.group, int(req.layer), int(req.step)
        g = reg.groups.get(group)
        if g is None:
            raise InvalidArgumentError(f"group: unknown cache group {group!r}; registered: {', '.join(reg.groups)}",
                                       field="group")  # fmt: skip
        if layer >= g.layout.num_layers:
            raise InvalidArgumentError(f"layer: {layer} is not below {g.layout.num_layers} (group {group!r})",
                                       field="layer")  # fmt: skip
        if step not in self._steps:
            self._early.setdefault(step, []).append((group, layer))
            for old in [s for s in self._early if s <= step - MAX_STEPS]:
                del self._early[old]
            return local_pb2.LayerDoneResponse()
        return local_pb2.LayerDoneResponse(writes=self._layer(step, group, layer, reg))

    def _layer(self, step: int, group: str, layer: int, reg: Registration) -> int:
        writes = 0
        lay = reg.groups[group].layout
        if lay.num_regions == 1 and lay.num_layers > 1:
            return 0  # every layer in one region (cross-layer): the publish writes it whole
        ready: asyncio.Future[None] | None = None
        for r in self._steps[step]:
            for offer in list(self.pusher.offers.get(r.request_id, {}).values()):
                if offer.task is not None or offer.writer_given or group not in offer.spans:
                    continue  # already written whole, or a pull-style offer: the publish path has it
                if not _streamable(r, offer):
                    continue  # another engine than the publish's reader: the publish refuses its offer
                try:
                    rows = self._rows_of(offer, step, r, group, reg)
                except KvxferError as exc:  # this step cannot be streamed into it: the publish writes it
                    with log_context(request_id=r.request_id, peer=offer.reader.label):
                        log.debug("layer not streamed", extra={"error": exc.message, "group": group})
                    continue
                if rows is None:
                    continue
                mine, theirs, regions = rows
                keep = regions == lay.region_of_layer(layer)
                if not keep.any():
                    continue
                upto = self._upto(offer, r, group)
                if ready is None:
                    ready = self._layer_ready(step, group, layer)
                self._write(offer, group, layer, mine[keep], theirs[keep], r.start, upto, ready)
                writes += 1
        return writes

    def _layer_ready(self, step: int, group: str, layer: int) -> asyncio.Future[None]:
        """Done once the layer's KV is in memory: at once on a CPU; a GPU worker's event must complete first."""
        loop = asyncio.get_running_loop()
        event = self._events.get(step, {}).get((group, layer))
        if event is None:
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            return done
        device, handle = event
        return loop.run_in_executor(None, self._wait_event, device, handle)

    def _wait_event(self, device: int, handle: bytes) -> None:
        from kvxfer import cuda_ipc  # only GPU workers send events

        drv = cuda_ipc.driver()
        key = (device, handle)
        ev = self._opened.get(key)
        if ev is None:
            ev = self._opened[key] = drv.open_event(device, handle)
        drv.sync_event(device, ev)

    def _upto(self, offer: Offer, r: _Streamed, group: str) -> int:
        num_tokens, _reader_skip, at = offer.spans[group]
        assert num_tokens is not None
        return min(r.end, at + num_tokens)

    def _rows_of(
        self, offer: Offer, step: int, r: _Streamed, group: str, reg: Registration
    ) -> tuple[U64, U64, I64] | None:
        """The step's descriptors for ``offer`` in ``group`` (all layers; planned once per step)."""
        key = (offer.transfer_id, step, group)
        cached = self._rows.get(key)
        if cached is not None:
            return cached
        num_tokens, reader_skip, at = offer.spans[group]
        if num_tokens is None:
            return None  # a state group moves whole, at the publish
        lo, hi = max(r.start, at), min(r.end, at + num_tokens)
        if hi <= lo:
            return None
        g = reg.groups[group]
        theirs_layout = offer.reader.groups[group]
        granule = min(g.layout.block_size, theirs_layout.block_size)
        lo -= (lo - at) % granule  # whole chunks: a chunk the last step left partial is written again
        reader_ids, reader_at = token_span(group, offer.blocks[group], theirs_layout.block_size, -reader_skip,
                                           lo - at, hi - lo, "blocks")  # fmt: skip
        writer_ids, writer_at = token_span(group, r.blocks[group], g.layout.block_size, r.origins.get(group, 0), lo,
                                           hi - lo, "requests.blocks")  # fmt: skip
        rows = self.pusher.rank_rows(offer, reg, group, reader_ids, writer_ids, num_tokens=hi - lo,
                                     reader_skip=reader_at, writer_skip=writer_at)  # fmt: skip
        if not rows[0].shape[0]:
            return None
        self._rows[key] = rows
        return rows

    def _write(
        self, offer: Offer, group: str, layer: int, mine: U64, theirs: U64, start: int, upto: int,
        ready: asyncio.Future[None],
    ) -> None:  # fmt: skip
        """Chain one layer's WRITE after the previous step's of the same layer (a rewritten chunk lands last)."""
        key = (group, layer)
        before = offer.stream_tasks.get(key)
        offer.stream_tasks[key] = asyncio.get_running_loop().create_task(
            self._run(offer, key, before, mine, theirs, start, upto, ready)
        )

    async def _run(
        self, offer: Offer, key: tuple[str, int], before: asyncio.Task[None] | None, mine: U64, theirs: U64,
        start: int, upto: int, ready: asyncio.Future[None],
    ) -> None:  # fmt: skip
        if before is not None:
            with contextlib.suppress(BaseException):
                await before
        written = offer.streamed.get(key, offer.spans[key[0]][2])
        t0 = time.monotonic()
        try:
            await asyncio.shield(ready)  # a GPU layer's kernels must have written it (its event)
            await self.pusher.write_rows(offer, mine, theirs)
        except (KvxferError, OSError) as exc:
            offer.stream_failed = True
            with log_context(request_id=offer.request_id, transfer_id=offer.transfer_id, peer=offer.reader.label):
                log.info("layer WRITE failed; the publish writes the request whole", extra={"error": str(exc)})
            return
        offer.stream_bytes += int(mine[:, 1].sum())
        offer.stream_descriptors += int(mine.shape[0])
        offer.stream_seconds += time.monotonic() - t0
        if start <= written:  # contiguous with what earlier steps wrote
            offer.streamed[key] = max(written, upto)
        reg = self.registry.registration
        if reg is not None and all(offer.covered(n, g.layout.num_layers) for n, g in reg.groups.items()):
            # Every byte the reader needs has landed: it may start now, not when the publish comes.
            self.pusher.landed_early(offer)


def _streamable(req: _Streamed, offer: Offer) -> bool:
    """Whether ``offer`` may be written the stream of ``req``: its publish will be bound to ``req.reader``
    (when the worker named one), so another engine's offer is not written before the publish refuses it
    (PERMISSION_DENIED, as for an offer that comes after such a publish)."""
    return not req.reader or offer.reader.engine_id == req.reader
