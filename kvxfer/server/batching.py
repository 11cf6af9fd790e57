"""Per-peer batching of small control-plane calls.

Under load a reader owes one publisher many small calls at once (a lookup per pull, a completion
notice per pull). Each gRPC call costs both processes far more CPU than the few fields it carries,
so calls owed to one peer while a call to it is under way are sent together, as one batch, when it
returns. Without a linger an idle peer gets each call at once (no timer, no added latency): batches
form only under load, and their size adapts to it. Calls off every critical path (a DONE notice)
may *linger*: the first waits that long for company before it leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["Coalescer"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")

#: ``send(key, items)`` answers one result per item, in order; an exception in that list fails only
#: its own item, an exception raised by ``send`` fails the whole batch.
SendFn = Callable[[K, list[T]], Awaitable[list[Any]]]


class Coalescer(Generic[K, T, R]):
    """Queues items per key; one sender per key sends whatever queued up while it was busy.

    ``linger``: seconds an item that finds its key idle waits for others before the batch leaves
    (0: at once). ``on_dropped(key, n)``: told of the ``n`` items that were never answered because the
    key's sender was cancelled (the sidecar closing), whose callers may no longer be there to tell.
    """

    def __init__(
        self, send: SendFn[K, T], spawn: Callable[[Coroutine[Any, Any, Any]], None], *, max_batch: int = 1024,
        linger: float = 0.0, on_dropped: Callable[[K, int], None] | None = None,
    ) -> None:  # fmt: skip
        self._send = send
        self._linger = linger
        self._on_dropped = on_dropped
        self._max_batch = max_batch  # a peer refuses larger batches whole (MAX_BATCH)
        self._spawn = spawn
        self._queues: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._busy: set[K] = set()

    def submit(self, key: K, item: T) -> asyncio.Future[R]:
        """Queue ``item`` for ``key``; the future gets its result (cancel it to drop the item)."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, []).append((item, fut))
        if key not in self._busy:
            self._busy.add(key)
            self._spawn(self._run(key))
        return fut

    def pending(self, key: K) -> int:
        """Items queued for ``key`` and not yet sent."""
        return len(self._queues.get(key, ()))

    async def _run(self, key: K) -> None:
        try:
            if self._linger > 0:
                await asyncio.sleep(self._linger)
            while self._queues.get(key):
                # Items whose caller gave up (cancelled future) are not sent at all; beyond
                # max_batch the rest waits for the next round.
                queued = [(item, fut) for item, fut in self._queues.pop(key) if not fut.done()]
                batch, rest = queued[: self._max_batch], queued[self._max_batch :]
                if rest:
                    self._queues.setdefault(key, [])[:0] = rest
                if not batch:
                    continue
                try:
                    results = await self._send(key, [item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        self._drop(key, [fut for _, fut in batch])
                        raise
                    # Cancelled from below (not this task): a failure of this batch only.
                    results = [RuntimeError("the call was cancelled")] * len(batch)
                except Exception as exc:
                    results = [exc] * len(batch)
                for (_, fut), res in zip(batch, results, strict=True):
                    _settle(fut, res)
        finally:
            self._busy.discard(key)
            # Cancelled (the sidecar is closing): nobody will send what is still queued.
            self._drop(key, [fut for _, fut in self._queues.pop(key, [])])

    def _drop(self, key: K, futures: list[asyncio.Future[R]]) -> None:
        dropped = [fut for fut in futures if not fut.done()]
        for fut in dropped:
            fut.cancel()
        if dropped and self._on_dropped is not None:
            self._on_dropped(key, len(dropped))


def _settle(fut: asyncio.Future[Any], res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
