"""Busy polling: the event loop does not sleep between hot calls while they come fast, or for a while after each.

A sidecar whose event loop sleeps in ``epoll_wait`` between calls pays for waking up on the next
one: on the lent VMs a thread that slept takes 100-200 us to run again (docs/notes/gpu.md, runs 10
and 11), on every pull's way in. Kept polling, the loop sees the frame as soon as it lands.

:class:`BusyPoll` keeps one callback scheduled while it is on, so the loop polls its sockets with a
zero timeout on every turn; each frame on the fast socket or the peer frames listener
(:mod:`kvxfer.server.fast_api`) calls :meth:`BusyPoll.poke`. Two things keep it on:

- **the rate** (``--busy-poll-above-rate``, on by default): while the hot calls come faster than
  that many a second (a running mean over about the last eight gaps between them), each keeps
  the loop polling for :data:`RATE_WINDOW_GAPS` gaps at that rate. At such a rate the loop is
  busy most of the time anyway, so polling its short idle gaps costs little of a core, and the
  wake-ups it spares are what the tail of a loaded sidecar's latency is made of. Once the calls
  slow down, the loop sleeps again within a few milliseconds;
- **a window** (``--busy-poll-seconds``, off by default): each call keeps it polling that many
  seconds more whatever the rate. The decode scheduler's Expect comes before its workers' pulls,
  and a prefill sidecar's Hold before its lookups and notices, so a window of tens of
  milliseconds covers the pull that follows even when pulls are rare. It costs a core for as long
  as it polls: for hosts that give each sidecar a core of its own.

Polling takes a core, so by default :func:`rate_under_limit` keeps the rate's polling off (from
what :mod:`kvxfer.server.cpu_room` reads of the machine), and
says why, where there is no core to spare: under a CPU limit (a container's cgroup quota, e.g.
Kubernetes ``resources.limits.cpu``) below :data:`MIN_POLL_CPU_CORES`, where a loop that polls
spends the quota and the kernel then stops the whole container until the next period, and on a
host (the CPUs this process may run on) of fewer than :data:`MIN_POLL_HOST_CORES`, shared with the
inference workers and the other ranks' sidecars (on the 2-core CPU machine both sidecars polling
left the worker too little: docs/sidecar.md, "Busy polling above a rate").
"""

from __future__ import annotations

import asyncio
import math
import time

__all__ = [
    "GAP_WEIGHT", "MIN_POLL_CPU_CORES", "MIN_POLL_HOST_CORES", "RATE_WINDOW_GAPS", "BusyPoll", "rate_under_limit",
]  # fmt: skip

#: Weight of the newest gap in the running mean of the gaps between hot calls (about the last eight).
GAP_WEIGHT = 0.125
#: While the calls come faster than the rate, each keeps the loop polling this many gaps at that rate.
#: A gap longer than this counts as this long in the mean: an idle spell must not take the mean so
#: high that a burst of calls needs hundreds of them to bring it back.
RATE_WINDOW_GAPS = 4.0
#: The CPU limit (cores) below which polling above the rate stays off unless asked for: the polling
#: loop takes a core, and the sidecar's other threads (NIXL's progress thread, gRPC's poller) some more.
MIN_POLL_CPU_CORES = 1.5
#: The CPUs this process may run on below which polling above the rate stays off unless asked for.
MIN_POLL_HOST_CORES = 4


def rate_under_limit(rate: float, limit_cores: float | None, cores: int, *, asked: bool) -> tuple[float, str]:
    """The rate to poll above under a CPU limit of ``limit_cores`` on ``cores`` CPUs, and why it differs ('' when not).

    ``asked``: the rate was set explicitly (a flag, the environment, a config file); it is kept, and
    the reason becomes a warning. By default polling stays off under a limit below
    :data:`MIN_POLL_CPU_CORES` and on fewer than :data:`MIN_POLL_HOST_CORES` CPUs.
    """
    if rate <= 0:
        return rate, ""
    if limit_cores is not None and not math.isnan(limit_cores) and limit_cores < MIN_POLL_CPU_CORES:
        why = (
            f"this container's CPU limit is {limit_cores:g} cores, below {MIN_POLL_CPU_CORES:g}: a loop that polls "
            "spends the quota and the kernel then stops the whole container until the next period"
        )
    elif cores < MIN_POLL_HOST_CORES:
        why = (
            f"this process may run on {cores} CPUs, fewer than {MIN_POLL_HOST_CORES}: a loop that polls takes a core "
            "the inference workers and the other sidecars need"
        )
    else:
        return rate, ""
    return (rate, why) if asked else (0.0, why)


class BusyPoll:
    """Keeps ``loop`` polling, never sleeping, while hot calls come faster than ``rate`` a second, and
    until ``window`` seconds after the last :meth:`poke` (0 turns either off)."""

    __slots__ = ("_cap", "_last", "_loop", "_mean_gap", "_on", "_rate_gap", "_until", "polls", "rate", "window")

    def __init__(self, loop: asyncio.AbstractEventLoop, window: float, rate: float = 0.0) -> None:
        if window < 0:
            raise ValueError(f"window: must be >= 0 seconds, got {window}")
        if rate < 0:
            raise ValueError(f"rate: must be >= 0 calls a second, got {rate}")
        self._loop = loop
        self.window = window
        self.rate = rate
        self._rate_gap = 1.0 / rate if rate > 0 else 0.0  # the mean gap below which the loop polls
        self._cap = RATE_WINDOW_GAPS * self._rate_gap  # the longest gap the mean counts, and the window
        self._mean_gap = self._cap  # as after an idle spell
        self._last = -1.0  # time.monotonic() of the last poke (none yet)
        self._until = 0.0
        self._on = False
        #: Loop turns taken while polling (tests, and a check that it stops).
        self.polls = 0

    @property
    def on(self) -> bool:
        """Whether the loop is kept polling now."""
        return self._on

    @property
    def mean_gap(self) -> float:
        """The running mean of the seconds between hot calls (capped; meaningful only with a rate)."""
        return self._mean_gap

    def poke(self) -> None:
        """A hot call arrived: keep polling while the calls come fast, and for ``window`` seconds from now."""
        now = time.monotonic()
        until = now + self.window if self.window > 0 else 0.0
        if self._rate_gap > 0:
            if self._last >= 0:
                self._mean_gap += GAP_WEIGHT * (min(now - self._last, self._cap) - self._mean_gap)
            self._last = now
            if self._mean_gap < self._rate_gap:
                until = max(until, now + self._cap)
        if until <= self._until:
            return
        self._until = until
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
