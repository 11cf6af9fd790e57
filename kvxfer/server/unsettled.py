"""Failed pulls whose READs may still land in their blocks, until each READ is seen to end.

A pull that fails with reason ``DATA_PLANE_UNFENCED`` had a data-plane operation still in flight
when the fence budget ran out (docs/transports.md, "What a cancel or a timeout guarantees"). Its
blocks are the worker's: if vLLM recomputed into them, or gave them to another request, the late
bytes would overwrite that KV. So the worker keeps them until this sidecar no longer names the
pull in ``GetStatus.unsettled``: every operation it left in flight ended (the transport saw it), or
``--unfenced-hold-seconds`` ran out since the failure (an operation no one can watch: a writer's
WRITE in push mode, one the library lost sight of, one that never ends), which is logged as an
error.

Nobody need ask for ended operations to be let go: while any are held, the sidecar looks again every
:data:`WATCH_INTERVAL_S` (:meth:`UnsettledPulls.watch`), so an idle sidecar still releases the
data plane's handles of operations that ended and logs the holds that ran out when they do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from kvxfer.logs import get_logger
from kvxfer.transport import UnfencedOp

__all__ = ["UnsettledPulls"]

log = get_logger("kvxfer.server.unsettled")

#: How often an idle sidecar looks again at the operations it holds (one call into the data plane).
WATCH_INTERVAL_S = 1.0
#: The longest gap between two looks while no pull is held (only the data plane keeps operations).
MAX_WATCH_INTERVAL_S = 30.0


class UnsettledPulls:
    """By request id (as pulled): the operations its failed pulls left in flight, each with when its pull failed."""

    def __init__(
        self, hold_s: float, look_again: Callable[[], int], clock: Callable[[], float] = time.monotonic,
        interval_s: float = WATCH_INTERVAL_S,
    ) -> None:  # fmt: skip
        self.hold_s = hold_s
        #: The transport's unfenced_live(): marks ended operations, releases their handles, and
        #: answers how many it still keeps.
        self._look_again = look_again
        self._clock = clock
        self.interval_s = interval_s
        self._pulls: dict[str, list[tuple[float, UnfencedOp]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._interval = interval_s  # the next look's delay while only the data plane keeps operations
        self._closed = False

    def __len__(self) -> int:
        """Pulls still unsettled as far as is known without asking the data plane: the gauge reads it from
        the metrics thread, so it only reads (what ended, whose hold ran out, counts as let go)."""
        now = self._clock()
        pulls = list(self._pulls.values())  # one step under the GIL: the loop may change the dict meanwhile
        return sum(any(not op.ended and now - since < self.hold_s for since, op in ops) for ops in pulls)

    def add(self, request_id: str, ops: Sequence[UnfencedOp]) -> None:
        """A pull of ``request_id`` failed unfenced; ``ops`` are what it left in flight (none known:
        no one can watch them, so the hold runs out). Each is held from this failure; pulls whose hold
        ran out are let go now (nobody may ask about them)."""
        now = self._clock()
        self._prune(now)
        ops = list(ops) or [UnfencedOp("READ", "", watched=False)]
        self._pulls.setdefault(request_id, []).extend((now, op) for op in ops)
        self.watch()

    def watch(self) -> None:
        """Look again every :attr:`interval_s` until nothing is held here and the data plane keeps no
        unfenced operation (called as the transport reports one, and by :meth:`add`). While only
        the data plane keeps some (no pull is held), the interval doubles up to
        :data:`MAX_WATCH_INTERVAL_S`: an operation whose peer never answers is not asked about every
        second for ever. Call it on the event loop's thread; outside an event loop, once closed, or
        already watching, it does nothing."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = self._interval if not self._pulls else self.interval_s
        if self._timer is not None:
            if self._timer.when() <= loop.time() + delay:
                return
            self._timer.cancel()  # a pull is held now: no waiting out the data plane's long gap
        self._timer = loop.call_later(delay, self._tick)

    def close(self) -> None:
        """Stop watching for good (the sidecar is stopping: its data plane closes next)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        try:
            kept = self._look_again()
        except Exception:  # a library error must not end the watch: look again next time
            log.exception("looking again at the data plane's unfenced operations failed")
            kept = 1
        self._prune(self._clock())
        self._interval = self.interval_s if self._pulls else min(self._interval * 2, MAX_WATCH_INTERVAL_S)
        if kept or self._pulls:
            self.watch()

    def in_flight(self, ops: Sequence[UnfencedOp]) -> int:
        """How many of ``ops`` have not been seen to end (the data plane is asked again first)."""
        if not ops:
            return 0
        self._look_again()
        return sum(not op.ended for op in ops)

    def still(self, request_ids: Iterable[str]) -> list[str]:
        """Of ``request_ids``, those whose failed pull may still have bytes landing in its blocks."""
        if not self._pulls:
            return []
        self._look_again()
        self._prune(self._clock())
        return [rid for rid in request_ids if rid in self._pulls]

    def _prune(self, now: float) -> None:
        """Forget the operations that ended, and those whose hold ran out (logged as an error)."""
        for rid, ops in list(self._pulls.items()):
            left = [(since, op) for since, op in ops if not op.ended]
            kept = [(since, op) for since, op in left if now - since < self.hold_s]
            if kept:
                self._pulls[rid] = kept
            else:
                del self._pulls[rid]
            lost = [op for since, op in left if now - since >= self.hold_s]
            if lost:
                log.error(
                    "a failed pull's READ was not seen to end within --unfenced-hold-seconds; its blocks go back to "
                    "the worker, and bytes may still land in them",
                    extra={"request_id": rid, "peer": ",".join(sorted({op.peer for op in lost})),
                           "hold_seconds": self.hold_s},
                )  # fmt: skip
