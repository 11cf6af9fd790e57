"""Errors <-> gRPC statuses, with a machine-readable reason that crosses the process.

A failed call carries, besides its status code and human message, a ``google.rpc.Status`` in the
status details (trailing metadata ``grpc-status-details-bin``) holding one ``google.rpc.ErrorInfo``:
``reason`` is a :class:`kvxfer.errors.Reason`, ``domain`` is ``kvxfer`` and ``metadata["field"]``
the field the failure is about. One failed item of a batch carries the same in its result
message (``reason``, ``field``). Code branches on the reason, never on the message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvxfer.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvxferError,
    NotFoundError,
    PeerUnavailableError,
    PermissionDeniedError,
    Reason,
    UnauthenticatedError,
)

__all__ = [
    "DETAILS_KEY",
    "DOMAIN",
    "abort",
    "code_of",
    "error_from_status",
    "error_from_status_message",
    "error_of",
    "parse_reason",
    "reason_of",
    "status_code",
    "status_message",
    "status_of",
]

DOMAIN = "kvxfer"
DETAILS_KEY = "grpc-status-details-bin"

# What a reason-less failure of each code means (a peer of an older build, gRPC's own errors).
_REASON_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_FIELD,
    grpc.StatusCode.NOT_FOUND: Reason.NOT_PUBLISHED,
    grpc.StatusCode.ALREADY_EXISTS: Reason.DUPLICATE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE,
    grpc.StatusCode.ABORTED: Reason.ABORTED,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: Reason.IDENTITY,
    grpc.StatusCode.UNIMPLEMENTED: Reason.UNSUPPORTED,
    grpc.StatusCode.UNAVAILABLE: Reason.PEER_UNREACHABLE,
    grpc.StatusCode.CANCELLED: Reason.ABORTED,
}


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code an exception maps to (INTERNAL for anything unexpected)."""
    if isinstance(exc, KvxferError):
        try:
            return grpc.StatusCode[exc.status]
        except KeyError:
            return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.INTERNAL


def reason_of(exc: BaseException) -> Reason:
    """The machine-readable reason of an exception (INTERNAL for anything unexpected)."""
    return exc.reason if isinstance(exc, KvxferError) else Reason.INTERNAL


def status_message(exc: KvxferError, message: str | None = None) -> status_pb2.Status:
    """The ``google.rpc.Status`` of an error: code, message, and the ErrorInfo with reason and field.

    What gRPC carries in ``grpc-status-details-bin``, and what an error frame of the local fast
    socket (:mod:`kvxfer.wire.frames`) carries as its payload.
    """
    info = error_details_pb2.ErrorInfo(reason=exc.reason.value, domain=DOMAIN)
    if exc.field:
        info.metadata["field"] = exc.field
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=code_of(exc).value[0], message=message or exc.message, details=[detail])


def status_of(exc: KvxferError, message: str | None = None) -> grpc.Status:
    """The full status of an error: code, message, and the ErrorInfo with reason and field."""
    out: grpc.Status = rpc_status.to_status(status_message(exc, message))
    return out


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: KvxferError, message: str | None = None) -> NoReturn:
    """End the call with ``exc``'s status (code, message, reason and field)."""
    await context.abort_with_status(status_of(exc, message))
    raise AssertionError("unreachable: abort_with_status raises")  # pragma: no cover


def error_from_status(
    code: grpc.StatusCode, message: str, trailing_metadata: Iterable[tuple[str, Any]] | None
) -> tuple[Reason, str | None]:
    """(reason, field) of a failed call: from its ErrorInfo, else the one its code implies."""
    for key, value in trailing_metadata or ():
        if key != DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value if isinstance(value, bytes) else bytes(value))
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == DOMAIN:
                return parse_reason(info.reason, code), info.metadata.get("field") or None
    return _REASON_OF_CODE.get(code, Reason.INTERNAL), None


def error_from_status_message(raw: bytes) -> tuple[grpc.StatusCode, str, Reason, str | None]:
    """(code, message, reason, field) of a serialized ``google.rpc.Status`` (see :func:`status_message`).

    Read exactly as a failed gRPC call's status details are (:func:`error_from_status`), so a
    failure reads the same whichever way it travelled.
    """
    status = status_pb2.Status.FromString(raw)
    code = status_code(status.code)
    reason, field = error_from_status(code, status.message, ((DETAILS_KEY, raw),))
    return code, status.message, reason, field


def parse_reason(value: str, code: grpc.StatusCode) -> Reason:
    """A reason received as text; empty or unknown (a newer peer's) reads as the one ``code`` implies."""
    try:
        return Reason(value)
    except ValueError:
        return _REASON_OF_CODE.get(code, Reason.INTERNAL)


def status_code(value: int) -> grpc.StatusCode:
    """The :class:`grpc.StatusCode` of a numeric code (UNKNOWN for a number gRPC does not define)."""
    return _CODE_OF_NUMBER.get(value, grpc.StatusCode.UNKNOWN)


_CODE_OF_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def error_of(code: grpc.StatusCode | int, message: str, reason: str = "", field: str | None = None) -> KvxferError:
    """A typed error for a failure received as (code, message, reason, field): one item of a batch."""
    if isinstance(code, int):
        code = status_code(code)
    why = parse_reason(reason, code)
    cls = _CLASS_OF_CODE.get(code)
    if cls is None:
        out = KvxferError(message, field=field, reason=why)
        out.status = code.name  # keep the peer's code
        return out
    return cls(message, field=field, reason=why)


_CLASS_OF_CODE: dict[grpc.StatusCode, type[KvxferError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}
