"""Transport errors: each names the backend, the peer, the memory involved and what the library said."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError, Reason
from kvxfer.topology import RegionTable


def describe_span(descs: npt.NDArray[np.uint64] | None) -> str:
    """`N descriptors over [lo, hi) on device d` for an (N, 3) descriptor array."""
    if descs is None or descs.size == 0:
        return "no descriptors"
    lo = int(descs[:, 0].min())
    hi = int((descs[:, 0] + descs[:, 1]).max())
    devs = sorted({int(d) for d in np.unique(descs[:, 2])})
    return f"{descs.shape[0]} descriptors over [{lo:#x}, {hi:#x}) on device {','.join(map(str, devs))}"


def _span(descs: npt.NDArray[np.uint64]) -> str:
    lo = int(descs[:, 0].min())
    hi = int((descs[:, 0] + descs[:, 1]).max())
    devs = sorted({int(d) for d in np.unique(descs[:, 2])})
    return f"[{lo:#x}, {hi:#x}) on device {','.join(map(str, devs))}"


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3, 7"``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def locate(tables: Sequence[RegionTable], descs: npt.NDArray[np.uint64]) -> str:
    """Which registered regions hold ``descs``: ``"regions 0-3, 7 of 16"`` (and what lies outside)."""
    if descs.size == 0:
        return "no descriptors"
    start = descs[:, 0]
    end = start + descs[:, 1]
    found = np.zeros(start.size, dtype=bool)
    parts: list[str] = []
    for i, table in enumerate(tables):
        order = np.argsort(table.base, kind="stable")
        base, stop = table.base[order], table.base[order] + table.size[order]
        k = np.searchsorted(base, start, side="right") - 1
        inside = (k >= 0) & (end <= stop[np.maximum(k, 0)]) & ~found
        if inside.any():
            found |= inside
            regions = np.unique(order[k[inside]]).tolist()
            which = f" of registration {i}" if len(tables) > 1 else ""
            parts.append(f"{_ranges(regions)} of {table.base.size}{which}")
    text = "regions " + "; ".join(parts) if parts else ""
    missing = int(start.size - found.sum())
    if missing:
        text += ("; " if text else "") + f"{missing} descriptors outside any registered region"
    return text


def describe_transfer(
    op: str, tables: Sequence[RegionTable], local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]
) -> str:
    """``READ of 28 descriptors (458752 B) into local regions 0-3 of 4 [..) from remote [..)``."""
    if local.size == 0:
        return f"{op} of no descriptors"
    into, other = ("into", "from") if op == "READ" else ("from", "to")
    return (
        f"{op} of {local.shape[0]} descriptors ({int(local[:, 1].sum())} B) {into} local "
        f"{locate(tables, local)} {_span(local)} {other} remote {_span(remote)}"
    )


class TransportError(KvxferError):
    """A data-plane operation failed."""

    status = "UNAVAILABLE"
    default_reason = Reason.DATA_PLANE

    def __init__(self, message: str, *, backend: str, peer: str | None = None, detail: str = "") -> None:
        where = f"{backend}" + (f" peer {peer!r}" if peer else "")
        text = f"{where}: {message}" + (f" (library: {detail})" if detail else "")
        super().__init__(text, field="data_plane")
        self.backend = backend
        self.peer = peer
        self.detail = detail
        self.what = message  # the message without the backend and peer


class TransferFailedError(TransportError):
    """A READ or WRITE ended in an error state or raised."""


class TransferTimeoutError(TransportError):
    """A transfer did not complete within its timeout; it was cancelled."""

    status = "DEADLINE_EXCEEDED"
    default_reason = Reason.DEADLINE


@dataclass(eq=False)
class UnfencedOp:
    """A data-plane operation reported failed (or cancelled) before the library said it ended.

    Its transport keeps watching it and sets :attr:`ended` once the library says it did: from then
    on no byte of it can land. ``watched`` False: no one can tell (the operation runs in another
    process, or the library lost sight of it), so :attr:`ended` never turns True.
    """

    op: str
    peer: str
    watched: bool = True
    ended: bool = False


class TransferUnfencedError(TransportError):
    """A transfer failed (timed out, errored) and its operation was still in flight when the fence budget
    (``TransportConfig.fence_budget_s``) ran out: its bytes may still land. The transport keeps the
    operation's handle until the library says it ended (``unfenced.ended``)."""

    default_reason = Reason.DATA_PLANE_UNFENCED

    def __init__(self, message: str, *, backend: str, peer: str | None = None, detail: str = "",
                 timed_out: bool = False, unfenced: UnfencedOp | None = None) -> None:  # fmt: skip
        super().__init__(message, backend=backend, peer=peer, detail=detail)
        self.timed_out = timed_out  # the failure was the transfer's timeout
        #: What to watch for the operation's end (one that cannot be watched when not given).
        self.unfenced = unfenced or UnfencedOp("?", peer or "", watched=False)


class PeerUnknownError(TransportError):
    """The peer was never added, or was removed."""

    status = "FAILED_PRECONDITION"


class RegistrationError(TransportError):
    """Memory could not be registered or deregistered."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.MEMORY


class BackendUnavailableError(TransportError):
    """The backend's library is missing or failed to start."""

    status = "FAILED_PRECONDITION"
    default_reason = Reason.DATA_PLANE_START
