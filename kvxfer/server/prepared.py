"""Pulls planned ahead (``Prepare``): the descriptors of a Pull that a worker is about to send.

The vLLM scheduler knows a decode request's blocks when it allocates them, a step before the
worker's Pull. ``Prepare`` gives this sidecar that Pull then. The sidecar checks it as it would
check the Pull, plans its READs from the publishers' handshakes (sources, descriptors), and keeps
the plan here by request id. The Pull that follows takes the plan when it is the same pull: the
same compared fields (:func:`plan_key`), this worker's registration unchanged, and the same
session with every publisher it reads. Otherwise, and for a Pull with no plan, the pull plans as
before.

A plan moves nothing and holds nothing: whether the blocks may be read is still decided by the
Pull (a grant, or the lookups). So a plan that is not used is only dropped: by its Pull, by an
Abort of its request, after ``--max-hold-seconds``, or as the oldest over :data:`MAX_PREPARED`
plans or :data:`MAX_PREPARED_DESCRIPTORS` descriptors.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.server.peers import PeerSession
from kvxfer.server.state import Registration
from kvxfer.wire import local_pb2

__all__ = ["MAX_PREPARED", "MAX_PREPARED_DESCRIPTORS", "PreparedPull", "PreparedPulls", "plan_key"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

#: Plans kept at most, and their descriptors at most (48 bytes each, local and remote): the oldest
#: go first, so a scheduler that prepares and never pulls cannot grow the sidecar.
MAX_PREPARED = 1024
MAX_PREPARED_DESCRIPTORS = 1 << 20


def plan_key(req: local_pb2.PullRequest) -> bytes:
    """The bytes of every field a plan depends on: all of the Pull's but wait, timeout_seconds and worker_gather.

    The request is serialized with those three cleared, then they are put back (it is the
    caller's parsed message; a copy of its block lists would cost more than this).
    """
    kept = (req.wait, req.timeout_seconds, req.worker_gather)
    req.wait, req.timeout_seconds, req.worker_gather = False, 0.0, False
    try:
        return req.SerializeToString(deterministic=True)
    finally:
        req.wait, req.timeout_seconds, req.worker_gather = kept


@dataclass(frozen=True)
class PreparedPull:
    """One planned pull: its checked block ids and each source rank's descriptors."""

    key: bytes  # plan_key of the Pull it was made for
    epoch: int  # this worker's registration it was planned against
    local_blocks: Mapping[str, I64]
    remote_given: Mapping[str, I64]
    #: The publisher sessions whose handshakes gave the remote regions, by remote rank.
    sessions: Mapping[int, PeerSession]
    #: Per remote rank, (local, remote) descriptor arrays per group, as pull_descriptors.descriptors makes them.
    per_rank: Mapping[int, list[tuple[U64, U64]]]
    warnings: tuple[str, ...]
    until: float  # time.monotonic(): dropped after

    @functools.cached_property
    def descriptors(self) -> int:
        """Descriptors the plan holds (what it costs to keep; counted once, as it is kept and as it goes)."""
        return sum(local.shape[0] for parts in self.per_rank.values() for local, _ in parts)

    def fits(self, reg: Registration, used: Mapping[int, PeerSession]) -> bool:
        """Whether the plan holds for a pull into ``reg`` that reads these publisher sessions."""
        return (
            reg.epoch == self.epoch
            and used.keys() == self.sessions.keys()
            and all(self.sessions[q] is s for q, s in used.items())
        )


class PreparedPulls:
    """The plans waiting for their Pull, by request id (see the module docs)."""

    def __init__(self) -> None:
        self._by_request: dict[str, PreparedPull] = {}
        self._descriptors = 0

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    @property
    def descriptors(self) -> int:
        """Descriptors held by every plan kept."""
        return self._descriptors

    def put(self, request_id: str, plan: PreparedPull) -> None:
        """Keep ``plan`` for ``request_id`` (replacing one); drops the expired and the oldest over the caps."""
        self._pop(request_id)
        self._by_request[request_id] = plan
        self._descriptors += plan.descriptors
        now = time.monotonic()
        # Insertion order is arrival order: expired plans sit at the front.
        while self._by_request:
            first = next(iter(self._by_request))
            within = len(self._by_request) <= MAX_PREPARED and self._descriptors <= MAX_PREPARED_DESCRIPTORS
            if within and self._by_request[first].until > now:
                break
            self._pop(first)

    def take(self, request_id: str, key: bytes) -> PreparedPull | None:
        """The plan of ``request_id``, removed, if it was made for a Pull with this ``key`` and has not expired."""
        plan = self._pop(request_id)
        if plan is None or plan.key != key or plan.until <= time.monotonic():
            return None
        return plan

    def discard(self, request_id: str) -> bool:
        """Drop the plan of ``request_id`` (aborted); False when there was none."""
        return self._pop(request_id) is not None

    def clear(self) -> None:
        """Drop every plan (the worker is gone or registered again)."""
        self._by_request.clear()
        self._descriptors = 0

    def _pop(self, request_id: str) -> PreparedPull | None:
        plan = self._by_request.pop(request_id, None)
        if plan is not None:
            self._descriptors -= plan.descriptors
        return plan
