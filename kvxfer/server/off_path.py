"""Work off every pull's critical path, run when no pull is waiting for it.

One event loop serves a decode sidecar's pulls and everything around them: the scheduler's quiet
``Expect`` calls, the publishers' answers to its holds, each finished pull's bookkeeping (metrics,
completion event, the DONE notice queued). Under load a Pull that arrives behind a queue of such
work waits for all of it, and that wait is what a pull's latency tail is made of; none of it is
urgent (a request is expected tens of milliseconds before its pull, a notice lingers anyway).

:class:`OffPath` queues that work and runs it while no call on the critical path is in progress
(:meth:`OffPath.enter` / :meth:`OffPath.leave`, counted by the fast socket), or once its oldest item
has waited :data:`MAX_WAIT_S`, at most :data:`SLICE_S` of it per loop turn: a Pull then waits for
one slice at most, not for the queue. Nothing is dropped and the order of the items is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvxfer.logs import get_logger

__all__ = ["MAX_WAIT_S", "SLICE_S", "OffPath"]

log = get_logger("kvxfer.server")

#: The longest an item waits for the critical path to be clear before it runs anyway.
MAX_WAIT_S = 0.001
#: Work run per loop turn once started: a critical call that arrives meanwhile waits this long at most.
SLICE_S = 0.0002


class OffPath:
    """A queue of callables run off the critical path (see the module docs)."""

    def __init__(self, *, max_wait_s: float = MAX_WAIT_S, slice_s: float = SLICE_S) -> None:
        self.max_wait_s = max_wait_s
        self.slice_s = slice_s
        self._items: deque[tuple[float, Callable[..., Any], tuple[Any, ...]]] = deque()
        #: Calls on the critical path in progress (entered, not yet left).
        self.critical = 0
        self._soon: asyncio.Handle | None = None
        self._later: asyncio.TimerHandle | None = None
        self._later_at = 0.0
        #: Items run so far (tests, metrics).
        self.ran = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` once the critical path is clear (an exception is logged, not raised)."""
        self._items.append((time.monotonic(), fn, args))
        self._schedule()

    def enter(self) -> None:
        """A call on the critical path started."""
        self.critical += 1

    def leave(self) -> None:
        """A call on the critical path ended: queued work may run."""
        self.critical -= 1
        if not self.critical and self._items:
            self._schedule()

    @property
    def queued(self) -> int:
        """Items waiting."""
        return len(self._items)

    def _schedule(self) -> None:
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._soon = None
        if not self._items:
            return
        now = time.monotonic()
        due = self._items[0][0] + self.max_wait_s
        if self.critical and now < due:
            # A critical call is in progress: its leave() runs this again, or the oldest item's wait ends.
            if self._later is None or self._later_at > due:
                if self._later is not None:
                    self._later.cancel()
                self._later_at = due
                self._later = asyncio.get_running_loop().call_at(due, self._on_timer)
            return
        end = now + self.slice_s
        while self._items:
            _, fn, args = self._items.popleft()
            self.ran += 1
            try:
                fn(*args)
            except Exception:  # one item's bug must not stall the rest
                log.exception("work off the critical path failed", extra={"work": getattr(fn, "__qualname__", "")})
            if time.monotonic() >= end:
                break
        if self._items:
            self._schedule()

    def _on_timer(self) -> None:
        self._later = None
        self._drain()

    def close(self) -> None:
        """Run what is queued now (the sidecar stops) and cancel the timers."""
        for handle in (self._soon, self._later):
            if handle is not None:
                handle.cancel()
        self._soon = self._later = None
        while self._items:
            _, fn, args = self._items.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("work off the critical path failed", extra={"work": getattr(fn, "__qualname__", "")})
