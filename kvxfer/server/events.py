"""Completion events: a numbered log that every WatchCompletions stream follows.

Events are kept in a bounded ring so that a worker that (re)connects can replay what it missed
(``replay`` + ``after_sequence``); each live watcher has its own queue, so a slow watcher never
delays the transfers that emit events.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from kvxfer.logs import get_logger
from kvxfer.wire import local_pb2

__all__ = ["CompletionHub", "Kind"]

Kind = local_pb2.Completion.Kind
log = get_logger("kvxfer.server.events")


class CompletionHub:
    """Numbered completion events, fanned out to every watcher."""

    def __init__(self, backlog: int = 8192, queue_limit: int = 65536) -> None:
        self._seq = 0
        self._ring: deque[Any] = deque(maxlen=backlog)
        self._watchers: set[asyncio.Queue[Any]] = set()
        self._queue_limit = queue_limit
        self._closed = False

    @property
    def watchers(self) -> int:
        """How many streams are watching."""
        return len(self._watchers)

    def emit(
        self, kind: Any, request_id: str, *, transfer_id: str = "", code: int = 0, message: str = "",
        peer: str = "", stats: Any = None,
    ) -> local_pb2.Completion:  # fmt: skip
        """Record an event and hand it to every watcher; returns the Completion message."""
        self._seq += 1
        ev = local_pb2.Completion(
            sequence=self._seq, kind=kind, request_id=request_id, transfer_id=transfer_id, code=code,
            message=message, peer=peer, unix_ms=int(time.time() * 1000),
        )  # fmt: skip
        if stats is not None:
            ev.stats.CopyFrom(stats)
        self._ring.append(ev)
        for q in self._watchers:
            if q.qsize() >= self._queue_limit:
                # Drop the oldest for this watcher only; it can replay from the ring by sequence.
                q.get_nowait()
                log.warning("completion watcher is too slow; dropped one event", extra={"sequence": self._seq})
            q.put_nowait(ev)
        return ev

    async def watch(self, *, replay: bool = False, after: int = 0) -> AsyncIterator[Any]:
        """Events from now on (with ``replay``: first the buffered ones after ``after``)."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        if replay:
            for ev in self._ring:
                if ev.sequence > after:
                    q.put_nowait(ev)
        self._watchers.add(q)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield ev
        finally:
            self._watchers.discard(q)

    def close(self) -> None:
        """End every watch stream."""
        self._closed = True
        for q in self._watchers:
            q.put_nowait(None)
