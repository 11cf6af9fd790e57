"""Requests every reader gave up on before they were published here (prefill side, push mode).

A reader that revokes its offer, or whose offer lapses, before the request is published here will
not take the publish when it comes: the pusher remembers (request id, the engine that gave up) and,
at the publish, frees it at once. Only the engine a publish is bound to (``reader_engine_id``), or
any engine while it is unbound, can have given it up, so no reader can give up a publish meant for
another. :class:`GiveUps` is a :class:`~kvxfer.server.recent.RecentMemo`: bounded, and each entry
forgotten once its reader could no longer have waited for the publish.
"""

from __future__ import annotations

from kvxfer.server.recent import RecentMemo

__all__ = ["GiveUps"]


class GiveUps(RecentMemo[tuple[str, str], str]):
    """(request id, the engine that gave up) -> why, for at most ``kept`` pairs, each for ``seconds``."""

    def __init__(self, *, kept: int, seconds: float) -> None:
        super().__init__(kept=kept, seconds=seconds, group=lambda key: key[0])

    def remember(self, rid: str, engine_id: str, why: str) -> None:
        """``engine_id`` gave up on ``rid`` before it was published here."""
        self.put((rid, engine_id), why)

    def take(self, rid: str, bound: str) -> str | None:
        """At ``rid``'s publish, bound to engine ``bound`` ("": unbound): why it is unwanted (None: it is
        not), forgetting who gave up on it.

        Only the engine it is bound to, or any engine while it is unbound, can have given it up: a
        reader may not give up a publish meant for another.
        """
        why = None
        for key in sorted(self.keys_of(rid)):
            gave_up = self.pop(key)
            if gave_up is not None and why is None and bound in ("", key[1]):
                why = gave_up
        return why
