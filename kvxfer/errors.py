"""Error types shared by every layer of kvxfer, each with a status and a machine-readable reason.

Each error carries the gRPC status name it maps to (as a plain string, so this module stays free of
gRPC), a :class:`Reason` that code may branch on (it crosses processes in the status details, see
:mod:`kvxfer.wire.status`), and the name of the field or setting that was wrong, so that a server
answers with the right status code and a message that names the offending input. Messages are for
people; nothing decides anything by reading them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "BlockIdError",
    "ConfigError",
    "DeadlineError",
    "FailedPreconditionError",
    "IncompatibleLayoutError",
    "InvalidArgumentError",
    "KvxferError",
    "LayoutError",
    "NotFoundError",
    "PeerUnavailableError",
    "PermissionDeniedError",
    "Reason",
    "ResourceExhaustedError",
    "TopologyError",
    "UnauthenticatedError",
    "UnavailableError",
]


class Reason(enum.StrEnum):
    """Why a call failed, for code to branch on (``google.rpc.ErrorInfo.reason`` on the wire)."""

    INVALID_FIELD = "INVALID_FIELD"  # a request field or setting is missing or malformed
    NOT_REGISTERED = "NOT_REGISTERED"  # no KV caches registered yet
    REGISTRATION_BUSY = "REGISTRATION_BUSY"  # cannot replace a registration with work in flight
    RANK_TAKEN = "RANK_TAKEN"  # another worker rank holds this sidecar
    WRONG_ROLE = "WRONG_ROLE"  # the sidecar's --role does not allow the call
    WRONG_BACKEND = "WRONG_BACKEND"  # the sidecar's --backend does not fit the call or the worker's agent
    DRAINING = "DRAINING"  # the sidecar is draining
    DUPLICATE = "DUPLICATE"  # a request id already published or being pulled
    NOT_PUBLISHED = "NOT_PUBLISHED"  # no publish under that id (unknown, released, expired)
    UNKNOWN_TICKET = "UNKNOWN_TICKET"  # GatherDone names a gather no pull waits for (the pull ended, or never was)
    NOT_HANDSHAKEN = "NOT_HANDSHAKEN"  # a peer called before handshaking (or the callee restarted)
    INCOMPATIBLE_PEER = "INCOMPATIBLE_PEER"  # handshake refused: layouts, roles, versions differ
    PEER_MISMATCH = "PEER_MISMATCH"  # a remote sidecar is not the rank or engine it should be
    PEER_CHANGED = "PEER_CHANGED"  # a peer restarted or re-registered while being contacted
    PEER_UNREACHABLE = "PEER_UNREACHABLE"  # a peer's control plane cannot be reached
    SIDECAR_UNREACHABLE = "SIDECAR_UNREACHABLE"  # a worker cannot reach its own sidecar
    PEER_INPUT = "PEER_INPUT"  # a peer answered something unusable (ids or regions out of its layout)
    DATA_PLANE = "DATA_PLANE"  # the data plane failed a transfer
    DATA_PLANE_START = "DATA_PLANE_START"  # the data plane could not be started
    # a transfer failed, and its operation was still in flight when the fence budget ran out: its
    # bytes may still land in (READ) or be written to (WRITE) the memory it named
    DATA_PLANE_UNFENCED = "DATA_PLANE_UNFENCED"
    MEMORY = "MEMORY"  # memory a worker described cannot be used
    LAYOUT = "LAYOUT"  # a cache description is not a standardized layout, or two do not fit
    DEADLINE = "DEADLINE"  # ran past a deadline
    ABORTED = "ABORTED"  # aborted by the worker, a peer, or a shutdown
    UNAUTHENTICATED = "UNAUTHENTICATED"  # missing or wrong credentials
    IDENTITY = "IDENTITY"  # a peer claims an engine id its credentials do not carry
    NOT_BOUND_READER = "NOT_BOUND_READER"  # a publish is bound to another reader engine
    WORKER_GONE = "WORKER_GONE"  # the worker that registered the memory has exited
    INSECURE_LISTEN = "INSECURE_LISTEN"  # asked to listen beyond loopback with no credentials (see --insecure)
    UNSUPPORTED = "UNSUPPORTED"  # a feature this build or host does not have
    INTERNAL = "INTERNAL"  # a bug


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""

    #: The gRPC status name: the class's, or (an error received from a call) the one it came with.
    status: str = "INTERNAL"
    default_reason: ClassVar[Reason] = Reason.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.reason = reason or self.default_reason


class InvalidArgumentError(KvxferError):
    """A request field is missing or malformed."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


class NotFoundError(KvxferError):
    """No published request (or other object) under that id."""

    status = "NOT_FOUND"
    default_reason = Reason.NOT_PUBLISHED


class AlreadyExistsError(KvxferError):
    """A request id is already published or being pulled."""

    status = "ALREADY_EXISTS"
    default_reason = Reason.DUPLICATE


class FailedPreconditionError(KvxferError):
    """The sidecar or peer is not in a state to do this (no caches, incompatible peer, wrong role)."""

    status = "FAILED_PRECONDITION"


class UnavailableError(KvxferError):
    """The sidecar is draining."""

    status = "UNAVAILABLE"
    default_reason = Reason.DRAINING


class ResourceExhaustedError(KvxferError):
    """A message longer than a side accepts (``--max-message-bytes``), as gRPC answers one."""

    status = "RESOURCE_EXHAUSTED"
    default_reason = Reason.INVALID_FIELD


class PeerUnavailableError(KvxferError):
    """A peer sidecar or its data plane cannot be reached."""

    status = "UNAVAILABLE"
    default_reason = Reason.PEER_UNREACHABLE


class DeadlineError(KvxferError):
    """A transfer or call ran past its deadline."""

    status = "DEADLINE_EXCEEDED"
    default_reason = Reason.DEADLINE


class AbortedError(KvxferError):
    """The request was aborted (locally or by the peer)."""

    status = "ABORTED"
    default_reason = Reason.ABORTED


class UnauthenticatedError(KvxferError):
    """A call without valid credentials."""

    status = "UNAUTHENTICATED"
    default_reason = Reason.UNAUTHENTICATED


class PermissionDeniedError(KvxferError):
    """An authenticated caller asked for something its identity does not allow."""

    status = "PERMISSION_DENIED"
    default_reason = Reason.IDENTITY


class ConfigError(KvxferError, ValueError):
    """A setting is unknown or has a bad value; ``field`` is the setting's name (underscores)."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


class LayoutError(KvxferError, ValueError):
    """A cache description (shape, strides, dtype, numbers) is not a standardized layout."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.LAYOUT


class IncompatibleLayoutError(KvxferError):
    """Two layouts cannot exchange blocks; `differences` lists every reason."""

    status = "FAILED_PRECONDITION"
    default_reason = Reason.LAYOUT

    def __init__(self, differences: Sequence[str], *, field: str | None = "layout") -> None:
        self.differences = tuple(differences)
        super().__init__("incompatible KV-cache layouts: " + "; ".join(self.differences), field=field)


class TopologyError(KvxferError, ValueError):
    """A transfer cannot be planned (ranks, parallelism, unsupported combination)."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


class BlockIdError(TopologyError):
    """Block id lists are empty, out of range, duplicated or of mismatched length."""
