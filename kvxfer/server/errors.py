"""Errors the sidecar answers with, each bound to its gRPC status code.

Every error names the field or setting it is about (``field``) and says what was wrong with which
value, so a worker's log line is enough to fix the call. Core errors (:mod:`kvxfer.errors`) carry
their status as a string; :func:`grpc_code` turns either kind into a :class:`grpc.StatusCode`.
"""

from __future__ import annotations

import grpc

from kvxfer.errors import KvxferError

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "DeadlineError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotFoundError",
    "PeerUnavailableError",
    "UnavailableError",
    "grpc_code",
]


class InvalidArgumentError(KvxferError):
    """A request field is missing or malformed."""

    status = "INVALID_ARGUMENT"


class NotFoundError(KvxferError):
    """No published request (or other object) under that id."""

    status = "NOT_FOUND"


class AlreadyExistsError(KvxferError):
    """A request id is already published or being pulled."""

    status = "ALREADY_EXISTS"


class FailedPreconditionError(KvxferError):
    """The sidecar or peer is not in a state to do this (no caches, incompatible peer, wrong role)."""

    status = "FAILED_PRECONDITION"


class UnavailableError(KvxferError):
    """The sidecar is draining."""

    status = "UNAVAILABLE"


class PeerUnavailableError(KvxferError):
    """A peer sidecar or its data plane cannot be reached."""

    status = "UNAVAILABLE"


class DeadlineError(KvxferError):
    """A transfer or call ran past its deadline."""

    status = "DEADLINE_EXCEEDED"


class AbortedError(KvxferError):
    """The request was aborted (locally or by the peer)."""

    status = "ABORTED"


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code an exception maps to (INTERNAL for anything unexpected)."""
    if isinstance(exc, KvxferError):
        try:
            return grpc.StatusCode[exc.status]
        except KeyError:
            return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.INTERNAL
