"""Busy polling: the sidecar's event loop kept awake for a window after each incoming call.

A sidecar whose thread slept between pulls runs the next pull's CPU side several times slower than
one that stayed busy: on the lent H200's virtual machine, a gather's submission took 23 us back to
back and 183 us after a 20 ms sleep, the same numpy call 7 us and 70 us (``bench/gpu/gather_check.py
--gap-ms 20``; docs/notes/gpu.md, run 20). A thread that spins in the meantime keeps its core awake.

With ``--busy-poll-ms`` above 0, every call that reaches the sidecar (a worker's frame or gRPC call,
a peer's gRPC call) opens or extends a window of that length during which the event loop never
sleeps: a callback that reschedules itself with ``call_soon`` keeps its ready queue non-empty, so
each turn polls for I/O without blocking and handles it at once. It costs the loop's core for the
whole window (counted in ``kvxfer_busy_poll_seconds_total``), so it is off by default and meant for
sidecars on cores of their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class BusyPoll:
    """Keeps the running event loop polling, never sleeping, until ``window_s`` after the last :meth:`poke`.

    ``spent`` is told each window's length in seconds when it closes. A zero window makes
    :meth:`poke` do nothing. Not thread-safe: poke from the loop's own thread.
    """

    def __init__(
        self, window_s: float, spent: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        if window_s < 0:
            raise ValueError(f"busy_poll window must be >= 0 s, got {window_s}")
        self.window_s = window_s
        self._spent = spent
        self._clock = clock
        self._until = 0.0
        self._opened: float | None = None  # when the current window opened; None while the loop may sleep
        self.turns = 0  # loop turns spent polling, over the process's life

    @property
    def active(self) -> bool:
        """Whether a window is open (the loop is being kept awake)."""
        return self._opened is not None

    def poke(self) -> None:
        """Open a window, or extend the open one to ``window_s`` from now."""
        if self.window_s <= 0:
            return
        now = self._clock()
        self._until = now + self.window_s
        if self._opened is None:
            self._opened = now
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self.turns += 1
        now = self._clock()
        if now < self._until:
            asyncio.get_running_loop().call_soon(self._turn)
            return
        opened, self._opened = self._opened, None
        if self._spent is not None and opened is not None:
            self._spent(now - opened)
