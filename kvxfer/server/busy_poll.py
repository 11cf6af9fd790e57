"""Busy polling: the event loop never sleeps for a while after each hot call (``--busy-poll-seconds``).

A sidecar whose event loop sleeps in ``epoll_wait`` between calls pays for waking up on the next
one: on the lent VMs a thread that slept takes 100-200 us to run again (docs/notes/gpu.md, runs 10
and 11), on every pull's way in. Kept polling, the loop sees the frame as soon as it lands.

:class:`BusyPoll` keeps one callback scheduled while it is on, so the loop polls its sockets with a
zero timeout on every turn; each frame on the fast socket or the peer frames listener
(:mod:`kvxfer.server.fast_api`) calls :meth:`BusyPoll.poke`, which keeps it on for ``window``
seconds more. The decode scheduler's Expect comes before its workers' pulls, and a prefill
sidecar's Hold before its lookups and notices, so a window of tens of milliseconds covers the pull
that follows while an idle sidecar still sleeps. It costs a core for as long as it polls, which is
why it is off by default: for hosts that give each sidecar a core of its own.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["BusyPoll"]


class BusyPoll:
    """Keeps ``loop`` polling, never sleeping, until ``window`` seconds after the last :meth:`poke`."""

    __slots__ = ("_loop", "_on", "_until", "polls", "window")

    def __init__(self, loop: asyncio.AbstractEventLoop, window: float) -> None:
        if window < 0:
            raise ValueError(f"window: must be >= 0 seconds, got {window}")
        self._loop = loop
        self.window = window
        self._until = 0.0
        self._on = False
        #: Loop turns taken while polling (tests, and a check that it stops).
        self.polls = 0

    @property
    def on(self) -> bool:
        """Whether the loop is kept polling now."""
        return self._on

    def poke(self) -> None:
        """A hot call arrived: keep polling for ``window`` seconds from now (nothing when 0)."""
        if self.window <= 0:
            return
        self._until = time.monotonic() + self.window
        if not self._on:
            self._on = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        # A callback that is ready makes the next turn poll with a zero timeout; one that does not
        # reschedule itself lets the loop sleep again.
        self.polls += 1
        if time.monotonic() < self._until:
            self._loop.call_soon(self._turn)
        else:
            self._on = False
