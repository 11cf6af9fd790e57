"""gRPC glue: method handlers built from the service descriptors, and the token interceptor.

Handlers take the raw request bytes and parse them here, so that a malformed message is answered
with INVALID_ARGUMENT naming the message type (gRPC's own deserializer would answer INTERNAL).
Every call runs under a deadline: the client's, capped by a per-method server limit, so a call
without a deadline still ends. Sidecar errors become their status code and message; anything
unexpected is logged and answered INTERNAL without disturbing other calls.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvxfer.errors import DeadlineError, InvalidArgumentError, KvxferError, UnauthenticatedError
from kvxfer.logs import get_logger, log_context
from kvxfer.wire.status import abort

__all__ = ["TokenInterceptor", "parse_request", "run_unary", "service_handler", "snake_case"]

log = get_logger("kvxfer.server.rpc")

Context = grpc.aio.ServicerContext[Any, Any]
Unary = Callable[[Any, Context], Awaitable[Any]]
Stream = Callable[[Any, Context], AsyncIterator[Any]]


def snake_case(name: str) -> str:
    """The Python method name of an RPC (``GetStatus`` -> ``get_status``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def service_handler(
    service: Any, impl: object, *, limits: Mapping[str, float | None], default_limit: float = 30.0
) -> grpc.GenericRpcHandler:
    """A generic handler for ``service`` (a ServiceDescriptor) calling ``impl.<snake_case method>``.

    ``limits`` caps each method's run time on the server (the client's deadline, when shorter, wins);
    a limit of None marks a method that enforces its own deadline, so no second timer is armed.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        req_cls = GetMessageClass(method.input_type)
        fn = getattr(impl, snake_case(method.name))
        full = f"/{service.full_name}/{method.name}"
        limit = limits.get(method.name, default_limit)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _stream(fn, req_cls, full), response_serializer=_serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(fn, req_cls, full, limit), response_serializer=_serialize
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _serialize(msg: Any) -> bytes:
    return bytes(msg.SerializeToString())


def parse_request(raw: bytes, req_cls: Any) -> Any:
    """``raw`` as a ``req_cls`` message; INVALID_ARGUMENT naming the message type when it is not one."""
    try:
        return req_cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(
            f"request: malformed {req_cls.DESCRIPTOR.full_name} message: {exc}", field="request"
        ) from None


async def _parse(raw: bytes, req_cls: Any, context: Context) -> Any:
    try:
        return parse_request(raw, req_cls)
    except InvalidArgumentError as exc:
        await abort(context, exc)


def _unary(fn: Unary, req_cls: Any, full: str, limit: float | None) -> Callable[..., Awaitable[Any]]:
    async def handle(raw: bytes, context: Context) -> Any:
        req = await _parse(raw, req_cls, context)
        try:
            return await run_unary(fn, req, context, full, limit)
        except KvxferError as exc:
            await abort(context, exc)

    return handle


async def run_unary(fn: Unary, req: Any, context: Any, full: str, limit: float | None) -> Any:
    """One unary call of ``fn``: under its deadline, with its request id in the logs; any failure a KvxferError.

    ``context`` needs only ``time_remaining()`` (seconds, or None without a deadline); the gRPC
    handlers and the local fast socket (:mod:`kvxfer.server.fast_api`) both run their calls here,
    so a call fails the same way whichever way it came. ``limit`` as in :func:`service_handler`.
    """
    rid = getattr(req, "request_id", "") or None
    peer = getattr(req, "engine_id", "") or getattr(req, "remote_engine_id", "") or None  # the calling peer
    remaining = context.time_remaining() if limit is not None else None
    budget = None if limit is None else (limit if remaining is None else min(remaining, limit))
    t0 = time.monotonic()
    with log_context(request_id=rid, peer=peer):
        try:
            if budget is None:  # the method runs under its own deadline (see service_handler)
                return await fn(req, context)
            async with asyncio.timeout(budget):
                return await fn(req, context)
        except KvxferError:
            raise
        except TimeoutError:
            raise DeadlineError(
                f"{full}: did not finish within its deadline of {budget:.3g}s (after {time.monotonic() - t0:.3g}s)"
            ) from None
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("unexpected error", extra={"method": full})
            raise KvxferError(f"{full}: internal error: {type(exc).__name__}: {exc}") from None


def _stream(fn: Stream, req_cls: Any, full: str) -> Callable[..., AsyncIterator[Any]]:
    async def handle(raw: bytes, context: Context) -> AsyncIterator[Any]:
        req = await _parse(raw, req_cls, context)
        try:
            async for item in fn(req, context):
                yield item
        except KvxferError as exc:
            await abort(context, exc)

    return handle


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call except health checks.

    Kubernetes gRPC probes send no metadata, so ``grpc.health.v1.Health`` stays open. The token
    is compared in constant time and never logged or echoed.
    """

    OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = details.method
        if method.startswith(self.OPEN_PREFIXES):
            return await continuation(details)
        got = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
                break
        if got is not None and hmac.compare_digest(got, self._expected):
            return await continuation(details)
        why = (
            "missing 'authorization: Bearer <token>' metadata"
            if got is None
            else "the bearer token in 'authorization' metadata is not valid"
        )
        log.warning("unauthenticated call refused", extra={"method": method, "why": why})
        handler = await continuation(details)
        return _deny(handler, f"{method}: {why}")


def _deny(handler: grpc.RpcMethodHandler[Any, Any] | None, message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def unary(_req: Any, context: Context) -> Any:
        await abort(context, UnauthenticatedError(message, field="authorization"))

    async def stream(_req: Any, context: Context) -> AsyncIterator[Any]:
        await abort(context, UnauthenticatedError(message, field="authorization"))
        yield None  # pragma: no cover - abort raises

    if handler is not None and handler.response_streaming and not handler.request_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
