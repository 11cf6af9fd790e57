"""A bounded memory of recent events, each forgotten a while after it happened.

The sidecar remembers some things only for as long as they can still matter, and never more of
them than a peer could make it keep: a request every reader gave up on before its publish, a request
its worker abandoned. :class:`RecentMemo` holds such entries oldest first, drops the oldest past
``kept``, and forgets each ``seconds`` after it was put: on every access, and from a timer of its
own when nothing else comes, so that a burst of entries does not stay in memory until the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["RecentMemo"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentMemo(Generic[K, V]):
    """At most ``kept`` entries, each for ``seconds`` after it was put (a put again renews it).

    ``group`` maps a key to the group it belongs to (e.g. a request id for a (request id, engine)
    key); :meth:`keys_of` then lists a group's live keys without a scan.
    """

    def __init__(
        self, *, kept: int, seconds: float, group: Callable[[K], Hashable] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if kept < 1 or not seconds > 0:
            raise ValueError(f"kept must be >= 1 and seconds > 0, not {kept} and {seconds}")
        self.kept = kept
        self.seconds = seconds
        self._clock = clock
        self._group = group
        self._entries: OrderedDict[K, tuple[V, float]] = OrderedDict()  # oldest first
        self._groups: dict[Hashable, set[K]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The live keys, oldest first."""
        self._prune(self._clock())
        return iter(list(self._entries))

    def __contains__(self, key: object) -> bool:
        self._prune(self._clock())
        return key in self._entries

    def put(self, key: K, value: V) -> None:
        """Remember ``value`` under ``key`` from now on (the newest entry; the oldest may go)."""
        now = self._clock()
        self._prune(now)
        self._entries.pop(key, None)
        self._entries[key] = (value, now)
        if self._group is not None:
            self._groups.setdefault(self._group(key), set()).add(key)
        while len(self._entries) > self.kept:
            self._drop(next(iter(self._entries)))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.seconds, self._expire)

    def get(self, key: K) -> V | None:
        """The value under ``key``, or None once it was forgotten (or never put)."""
        self._prune(self._clock())
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def pop(self, key: K) -> V | None:
        """Forget ``key`` now; its value if it was still remembered."""
        self._prune(self._clock())
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._drop(key)
        return entry[0]

    def keys_of(self, group: Hashable) -> list[K]:
        """The live keys of ``group`` (needs ``group`` at construction)."""
        self._prune(self._clock())
        return list(self._groups.get(group, ()))

    def close(self) -> None:
        """Stop the expiry timer (the entries stay, and are still forgotten on access)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _prune(self, now: float) -> None:
        horizon = now - self.seconds
        while self._entries:
            key, (_value, at) = next(iter(self._entries.items()))
            if at >= horizon:
                break
            self._drop(key)

    def _drop(self, key: K) -> None:
        del self._entries[key]
        if self._group is not None:
            group = self._group(key)
            members = self._groups.get(group)
            if members is not None:
                members.discard(key)
                if not members:
                    del self._groups[group]

    def _expire(self) -> None:
        """Forget what is too old even when nothing else comes; re-armed for the oldest left."""
        self._timer = None
        now = self._clock()
        self._prune(now)
        if self._entries:
            _value, oldest = next(iter(self._entries.values()))
            delay = max(oldest + self.seconds - now, 0.0) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)
