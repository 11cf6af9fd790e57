"""How a pull that failed is told: the error each way of ending becomes, and its metric label.

A pull ends failed in one of three ways (:meth:`kvxfer.server.puller.Puller._run`): its deadline passed
(``timeout``), it was cancelled (``aborted``: the worker, an ``Abort``, a publisher's abort, shutdown) or
a step raised (``failed``). :func:`pull_failure` makes each the one ``KvxferError`` its worker hears, which
names the stage it was in. A READ of it (or a writer's WRITE, in push mode) still in flight after the
fence budget may land in its blocks however the pull ended, so such a failure says so and carries reason
``DATA_PLANE_UNFENCED`` (:func:`unfenced_behind` for a pull whose READs succeeded after an earlier
one was left so). :func:`metric_reason` is the failure's label in ``kvxfer_transfer_failures_total``.
"""

from __future__ import annotations

import asyncio

from kvxfer.errors import AbortedError, DeadlineError, KvxferError, PeerUnavailableError, Reason
from kvxfer.logs import get_logger
from kvxfer.server.landed import UNFENCED_WRITE
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.state import PullEntry

__all__ = ["metric_reason", "pull_failure", "unfenced_behind"]

log = get_logger("kvxfer.server")


def pull_failure(
    entry: PullEntry, exc: BaseException, budget: float, sessions: dict[int, PeerSession], peers: PeerDirectory
) -> tuple[KvxferError, str]:
    """The error a pull ended with, and its outcome label (timeout, aborted, failed)."""
    rid = entry.request_id
    if isinstance(exc, TimeoutError):
        if entry.stage.startswith("reading"):
            for s in sessions.values():
                # Only a session still current: a newer handshake's is another pull's to judge.
                peers.invalidate(s.address, reconnect=True, session=s)
        return DeadlineError(f"pull of {rid!r} did not finish within {budget:.3g}s (while {entry.stage})"
                             f"{_unfenced(entry)}", field="timeout_seconds",
                             reason=Reason.DATA_PLANE_UNFENCED if entry.unfenced else None), "timeout"  # fmt: skip
    if isinstance(exc, asyncio.CancelledError):
        why = entry.abort_reason or "the sidecar is shutting down"
        return AbortedError(f"pull of {rid!r} aborted: {why}{_unfenced(entry)}",
                            field="request_id",
                            reason=Reason.DATA_PLANE_UNFENCED if entry.unfenced else None), "aborted"  # fmt: skip
    if isinstance(exc, KvxferError):
        if entry.unfenced and exc.reason != Reason.DATA_PLANE_UNFENCED:
            # Another READ of it, cancelled because of this failure, may still land: the worker must hear it
            # (the error keeps its class and code; subclasses take other arguments, so it is amended).
            exc.message += _unfenced(entry)
            exc.args = (exc.message, *exc.args[1:])
            exc.reason = Reason.DATA_PLANE_UNFENCED
        return exc, "failed"
    log.exception("pull failed unexpectedly", exc_info=exc)
    return KvxferError(f"internal error in pull of {rid!r}: {type(exc).__name__}: {exc}"), "failed"


_UNFENCED = "; a READ of it was still in flight after the fence budget, so its bytes may still land in the blocks"


def _unfenced(entry: PullEntry) -> str:
    """What a failed pull's message adds when a READ (or a writer's WRITE, in push mode) of it was unfenced."""
    if not entry.unfenced:
        return ""
    return UNFENCED_WRITE if entry.push else _UNFENCED


def unfenced_behind(entry: PullEntry, n: int) -> KvxferError:
    """A pull whose READs succeeded while ``n`` earlier READs of it (from a registration its publisher has
    replaced since) may still land: reporting it moved would let its blocks be used under them."""
    return PeerUnavailableError(
        f"pull of {entry.request_id!r}: its blocks were read, but {n} earlier READ(s) of it, which failed, "
        "were still in flight after the fence budget, so their bytes may still land in the blocks",
        field="remote_addresses", reason=Reason.DATA_PLANE_UNFENCED,
    )  # fmt: skip


def metric_reason(err: KvxferError, outcome: str) -> str:
    """The ``reason`` label of kvxfer_transfer_failures_total (values the dashboard and contract name)."""
    if outcome in ("timeout", "aborted"):
        return outcome
    if err.reason in (Reason.DATA_PLANE, Reason.DATA_PLANE_UNFENCED):
        return "data_plane"
    return err.status.lower()
