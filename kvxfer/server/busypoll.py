"""Busy polling: the event loop keeps running for a while after a worker's call instead of sleeping.

A sidecar's loop sleeps in epoll between calls, and on the lent H200's VM a thread that slept for
milliseconds wakes and runs its first hundreds of microseconds several times slower than one that
kept running (``bench/local_hop.py --gap-ms``: a 31 us round trip becomes 125 us). A decode sidecar
knows a pull is near when its worker expects a request or pulls: with ``--busy-poll-ms N`` the loop
then polls without sleeping for N ms (one cheap callback per turn; I/O and every other callback
run between turns), at the price of a core while it polls. Off (0) by default.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["BusyPoll"]


class BusyPoll:
    """Keeps the running event loop turning without sleeping until ``seconds`` after the last :meth:`touch`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._until = 0.0
        self._polling = False
        self.turns = 0  # loop turns spent polling (tests, status)

    def touch(self) -> None:
        """A call came or a pull is near: poll until ``seconds`` from now."""
        if self.seconds <= 0:
            return
        self._until = time.monotonic() + self.seconds
        if not self._polling:
            self._polling = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        if time.monotonic() >= self._until:
            self._polling = False
            return
        self.turns += 1
        # A ready callback makes the loop poll its I/O with a zero timeout instead of sleeping.
        asyncio.get_running_loop().call_soon(self._turn)
