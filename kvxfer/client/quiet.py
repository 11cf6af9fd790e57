"""Calls nobody waits for: :meth:`QuietCalls.expect_quietly`, and the failures the sidecar answers them with.

Over the fast socket a quiet call gets an answer only when it failed; the failure arrives on the
channel's :attr:`kvxfer.fastsock.FastChannel.on_quiet_failure` hook, is logged and counted. A
sidecar too old for quiet calls refuses the frame: that call, and every later one of its method,
goes as the awaited call instead. :class:`kvxfer.client.aio.AsyncClient` is the one class built on
:class:`QuietCalls`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvxfer.client.fast import decode_answer
from kvxfer.client.types import KvxferRpcError
from kvxfer.fastsock import FastCallError, FastChannel
from kvxfer.logs import get_logger
from kvxfer.wire import local_pb2, local_pb2_grpc
from kvxfer.wire.frames import METHODS, QUIET_METHOD_OF_REQUEST, FastMethod

__all__ = ["QuietCalls"]

Q = TypeVar("Q", bound=Message)
R = TypeVar("R")

log = get_logger("kvxfer.client")


class QuietCalls:
    """The quiet calls of a local API client, and the log and count of their failures.

    A base of :class:`kvxfer.client.aio.AsyncClient`, which provides the connection and the calls
    declared here (its fast socket, ``_call``, ``expect``, ...).
    """

    if TYPE_CHECKING:  # what the client (AsyncClient) provides; nothing of it exists at run time here
        fast_socket: Path | None
        quiet_failures: int
        last_quiet_failure: KvxferRpcError | None
        _fast: FastChannel | None
        _fast_refused: set[int]
        _reports: set[asyncio.Task[Any]]
        _stub: local_pb2_grpc.LocalAsyncStub

        def call_timeout(self, req: Message, deadline: float | None) -> float: ...

        async def _fast_channel(self) -> FastChannel | None: ...

        async def _call(self, rpc: grpc.aio.UnaryUnaryMultiCallable[Q, R], req: Q, deadline: float | None) -> R: ...

        async def expect(
            self, request_id: str, remote_addresses: Sequence[str], *, deadline: float | None = None
        ) -> bool: ...

    async def expect_quietly(
        self, request_id: str, remote_addresses: Sequence[str], *, deadline: float | None = None
    ) -> None:
        """:meth:`expect` without waiting for its answer (the vLLM scheduler's way: it never waits for one).

        Over the fast socket the sidecar answers only a failure, which is then logged here (a warning
        with the request id, status, reason and field) and counted in :attr:`quiet_failures`; a
        success costs neither side an answer. Where the fast socket cannot carry it (gRPC only, a
        sidecar too old for quiet calls), this is :meth:`expect`, awaited, and raises as it does.
        """
        req = local_pb2.ExpectRequest(request_id=request_id, remote_addresses=list(remote_addresses))
        timeout = self.call_timeout(req, deadline)
        method = QUIET_METHOD_OF_REQUEST[local_pb2.ExpectRequest]
        if self.fast_socket is not None and method.number not in self._fast_refused:
            channel = self._fast if self._fast is not None and not self._fast.closed else await self._fast_channel()
            if channel is not None:
                try:
                    channel.tell(method.number, req.SerializeToString(), timeout)
                    return
                except FastCallError:
                    pass  # not sent: the awaited way below
        await self.expect(request_id, remote_addresses, deadline=deadline)

    def _quiet_failed(self, number: int, payload: bytes, code: int, status: bytes) -> None:
        """A quiet call's failure arrived: log and count it (an older sidecar's refusal: send it awaited)."""
        method = METHODS[number]
        try:
            req = method.request.FromString(payload)
            decode_answer(method, code, status)
            return  # an OK answer to a quiet call: nothing failed
        except KvxferRpcError as exc:
            error = exc
        except DecodeError:  # what this client sent: cannot happen
            log.exception("unreadable quiet call")
            return
        if error.code == grpc.StatusCode.UNIMPLEMENTED and error.field == "method":
            # A sidecar from before quiet calls refused the frame before running anything: this
            # call goes awaited, now, and so does every one of its method after it.
            self._fast_refused.add(method.number)
            task = asyncio.get_running_loop().create_task(self._send_awaited(method, req))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)
            return
        self._note_quiet_failure(req, error)

    async def _send_awaited(self, method: FastMethod, req: Message) -> None:
        """A quiet call the sidecar could not take quietly, as the awaited call of the same RPC."""
        try:
            await self._call(getattr(self._stub, method.name), req, None)
        except KvxferRpcError as exc:
            self._note_quiet_failure(req, exc)

    def _note_quiet_failure(self, req: Message, error: KvxferRpcError) -> None:
        """Count and log the failure of a call nobody waited for."""
        self.quiet_failures += 1
        self.last_quiet_failure = error
        rid = getattr(req, "request_id", "")
        log.warning(f"{error.method} of request {rid!r} failed: {error.message}", extra={
            "request_id": rid, "status": error.code.name, "reason": error.reason, "field": error.field,
        })  # fmt: skip
