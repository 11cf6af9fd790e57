"""The decode engine's nap while it only waits for KV, ended early by the load that ends.

vLLM steps without pause while a request waits for remote KV (``WAITING_FOR_REMOTE_KVS``), and in
push mode that wait is the whole remote prefill. On a host where the prefill shares cores with the
decode instance, those empty steps slow the prefill down. So an empty step naps, but a nap long
enough to matter would delay every load by up to its length: the nap here ends as soon as any
rank's sidecar reports a load ended (its completion stream: pulled, failed or aborted), and the
next steps then run without a nap for a moment, while the workers' own notices catch up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Sequence

from kvxfer.client import Client, KvxferRpcError

__all__ = ["LoadWaker"]

#: Completion kinds that end a load on the decode side.
_LOAD_ENDED = frozenset({"PULLED", "PULL_FAILED", "ABORTED"})
#: After a load ended, steps run without a nap this long: the sidecar told the scheduler, but the
#: worker that reports the load to vLLM may hear it a moment later.
HOT_SECONDS = 0.005
#: The longest wait before a lost completion stream is opened again.
RECONNECT_MAX_S = 5.0


class LoadWaker:
    """Naps that end when one of the engine's sidecars reports that a load ended.

    The streams run on the clients' own loops. While any of them is down, a nap is a plain sleep
    (a load that ends then is seen at the nap's end, as without this class).
    """

    def __init__(self, clients: Sequence[Client]) -> None:
        self._ended = threading.Event()
        self._live: set[int] = set()
        self._hot_until = 0.0
        self._closed = False
        self._watches: list[cf.Future[None]] = [c.submit(self._watch(i, c)) for i, c in enumerate(clients)]

    async def _watch(self, index: int, client: Client) -> None:
        failures = 0
        while not self._closed:
            self._live.add(index)
            try:
                async for ev in client.aio.watch_completions():
                    failures = 0
                    if ev.kind in _LOAD_ENDED:
                        self._ended.set()
            except KvxferRpcError:
                pass
            self._live.discard(index)
            if self._closed:
                return
            await asyncio.sleep(min(0.1 * 2**failures, RECONNECT_MAX_S))
            failures += 1

    def nap(self, seconds: float) -> bool:
        """Wait up to ``seconds``, less if a load ends meanwhile; True when one ended.

        Right after a load ended the engine does not nap at all (see :data:`HOT_SECONDS`).
        """
        now = time.monotonic()
        if now < self._hot_until or seconds <= 0:
            return False
        if len(self._live) < len(self._watches):  # a stream is down: it cannot wake us
            time.sleep(seconds)
            return False
        ended = self._ended.wait(seconds)
        if ended:
            self._ended.clear()
            self._hot_until = time.monotonic() + HOT_SECONDS
        return ended

    def close(self) -> None:
        """Stop the streams (the clients stay open)."""
        self._closed = True
        for fut in self._watches:
            fut.cancel()
        for fut in self._watches:
            with contextlib.suppress(BaseException):
                fut.result(timeout=2)
