"""Loads that failed while a READ of them may still land (reason ``DATA_PLANE_UNFENCED``), kept from vLLM.

Reported to vLLM, such a load's blocks would be recomputed into or given to another request while
late bytes can still arrive in them. :class:`UnsettledLoads` keeps them until the sidecar no longer
names the pull in ``GetStatus.unsettled`` (docs/transports.md, "Until an unfenced operation ends"),
asking at most every :data:`UNSETTLED_CHECK_SECONDS` and backing off while the sidecar does not
answer. A restarted sidecar knows none: its data plane, and every READ it posted, went with it.
With ``data_plane: worker`` the READs are the worker's own agent's, which outlives a sidecar
restart: a load is then also kept while the agent still runs a transfer that started before the
load failed, or has one reported unfenced that it has not yet seen end (``WorkerAgent.quiet_since``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.plan import PullSpec
from kvxfer.logs import get_logger

if TYPE_CHECKING:
    from kvxfer.worker_agent import WorkerAgent

__all__ = ["UNSETTLED_CHECK_SECONDS", "UnsettledLoads"]

log = get_logger("kvxfer.vllm.worker")

#: Least time between two look-ups of the loads kept.
UNSETTLED_CHECK_SECONDS = 0.1


class UnsettledLoads:
    """By vLLM request id: each load kept, its error, and when it was kept (time.monotonic()).

    ``ask(pull ids)`` answers which of them the sidecar still names unsettled (raising
    :class:`~kvxfer.errors.KvxferError` or TimeoutError when it cannot); at most ``batch`` ids go in one
    ask; a failed ask waits ``backoff_s`` doubling up to ``backoff_max_s`` before the next.
    """

    def __init__(
        self, ask: Callable[[list[str]], set[str]], *, target: str, batch: int, backoff_s: float, backoff_max_s: float
    ) -> None:
        self._ask = ask
        self._target = target  # the sidecar, for the log
        self._batch = batch
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._loads: dict[str, tuple[PullSpec, BaseException, float]] = {}
        self._next_check = 0.0
        self._failures = 0  # asks in a row the sidecar did not answer

    def __contains__(self, rid: object) -> bool:
        return rid in self._loads

    def keep(self, rid: str, spec: PullSpec, exc: BaseException) -> None:
        """Keep request ``rid``'s load, which failed with ``exc`` while a READ of it may still land."""
        self._loads[rid] = (spec, exc, time.monotonic())

    def take_settled(self, agent: WorkerAgent | None) -> list[tuple[str, PullSpec, BaseException]]:
        """The loads no READ of which can still land, each (request id, pull, error), no longer kept."""
        now = time.monotonic()
        if not self._loads or now < self._next_check:
            return []
        ids = {spec.remote.request_id: rid for rid, (spec, _, _) in self._loads.items() if spec.remote is not None}
        asked = sorted(ids)[: self._batch]
        try:
            still = self._ask(asked)
        except (KvxferError, TimeoutError) as exc:
            # Timed from the answer, and backing off: a sidecar that does not answer must not cost
            # every engine step a look-up's deadline.
            self._failures += 1
            wait = min(self._backoff_s * 2**self._failures, self._backoff_max_s)
            self._next_check = time.monotonic() + wait
            log.warning(f"could not ask the sidecar {self._target} whether {len(ids)} failed loads may still land; "
                        f"their blocks stay held (next try in {wait:g} s): {exc}")  # fmt: skip
            return []
        self._failures = 0
        self._next_check = time.monotonic() + UNSETTLED_CHECK_SECONDS
        settled = [ids[pid] for pid in asked if pid not in still]
        if agent is not None:
            settled = [rid for rid in settled if agent.quiet_since(self._loads[rid][2])]
        out: list[tuple[str, PullSpec, BaseException]] = []
        for rid in settled:
            spec, error, _ = self._loads.pop(rid)
            out.append((rid, spec, error))
        return out
