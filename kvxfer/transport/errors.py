"""Transport errors: each names the backend, the peer, the memory involved and what the library said."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError


def describe_span(descs: npt.NDArray[np.uint64] | None) -> str:
    """`N descriptors over [lo, hi) on device d` for an (N, 3) descriptor array."""
    if descs is None or descs.size == 0:
        return "no descriptors"
    lo = int(descs[:, 0].min())
    hi = int((descs[:, 0] + descs[:, 1]).max())
    devs = sorted({int(d) for d in np.unique(descs[:, 2])})
    return f"{descs.shape[0]} descriptors over [{lo:#x}, {hi:#x}) on device {','.join(map(str, devs))}"


class TransportError(KvxferError):
    """A data-plane operation failed."""

    status = "UNAVAILABLE"

    def __init__(self, message: str, *, backend: str, peer: str | None = None, detail: str = "") -> None:
        where = f"{backend}" + (f" peer {peer!r}" if peer else "")
        text = f"{where}: {message}" + (f" (library: {detail})" if detail else "")
        super().__init__(text, field="data_plane")
        self.backend = backend
        self.peer = peer
        self.detail = detail


class TransferFailedError(TransportError):
    """A READ or WRITE ended in an error state or raised."""


class TransferTimeoutError(TransportError):
    """A transfer did not complete within its timeout; it was cancelled."""

    status = "DEADLINE_EXCEEDED"


class PeerUnknownError(TransportError):
    """The peer was never added, or was removed."""

    status = "FAILED_PRECONDITION"


class RegistrationError(TransportError):
    """Memory could not be registered or deregistered."""

    status = "INVALID_ARGUMENT"


class BackendUnavailableError(TransportError):
    """The backend's library is missing or failed to start."""

    status = "FAILED_PRECONDITION"
