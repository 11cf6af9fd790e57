"""What the sidecar clients take and return, and how it maps to the local API's messages."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxfer.errors import InvalidArgumentError, KvxferError, Reason
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import MemoryRef
from kvxfer.wire import local_pb2
from kvxfer.wire.convert import (
    blocks_to_proto,
    layout_to_proto,
    memory_to_proto,
)
from kvxfer.wire.status import DETAILS_KEY, error_from_status, parse_reason, status_code

__all__ = [
    "BlockMap",
    "CacheGroupSpec",
    "CompletionEvent",
    "GroupsArg",
    "KvxferRpcError",
    "PullItem",
    "PullResult",
    "TokenSpan",
    "normalize_target",
]

BlockMap = Mapping[str, Sequence[int] | npt.NDArray[np.integer]]
GroupsArg = Sequence["CacheGroupSpec"] | Mapping[str, tuple[KVCacheLayout, MemoryRef]]


class KvxferRpcError(KvxferError):
    """A sidecar call failed: ``code`` is the gRPC status, ``details`` the sidecar's explanation,
    ``reason`` (a :class:`~kvxfer.errors.Reason`) and ``field`` what code may branch on."""

    def __init__(
        self, code: grpc.StatusCode, message: str, method: str = "", *, reason: Reason | None = None,
        field: str | None = None,
    ) -> None:  # fmt: skip
        text = f"{method}: {code.name}: {message}" if method else f"{code.name}: {message}"
        super().__init__(text, field=field, reason=reason or parse_reason("", code))
        self.code = code
        self.status = code.name  # what code_of() and every KvxferError reader take the code from
        self.details = message
        self.method = method

    @classmethod
    def of_call(cls, exc: grpc.aio.AioRpcError, method: str) -> KvxferRpcError:
        """The error of a failed call, with the reason and field from its status details."""
        code, details, md = exc.code(), exc.details() or "", exc.trailing_metadata()
        reason, field = error_from_status(code, details, md)
        if code == grpc.StatusCode.UNAVAILABLE and not any(key == DETAILS_KEY for key, _ in md or ()):
            # gRPC's own (the sidecar sends its reason with every failure): the worker's sidecar is not there.
            reason = Reason.SIDECAR_UNREACHABLE
        return cls(code, details, method, reason=reason, field=field)


@dataclass(frozen=True)
class CacheGroupSpec:
    """One cache group to register: its name, layout and where its memory is."""

    name: str
    layout: KVCacheLayout
    memory: MemoryRef


@dataclass(frozen=True)
class PullResult:
    """The answer to a pull."""

    transfer_id: str
    request_id: str
    done: bool
    bytes: int = 0
    descriptors: int = 0
    duration_seconds: float = 0.0
    data_seconds: float = 0.0
    remote_ranks: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()
    fetch_seconds: float = 0.0  # handshakes + GetPublished round trips (part of duration_seconds)


@dataclass(frozen=True)
class TokenSpan:
    """Which tokens of a group's block lists a pull moves (see ``BlockList`` in local.proto).

    Tokens ``[local_skip, local_skip + num_tokens)`` of the local list receive tokens
    ``[remote_skip, remote_skip + num_tokens)`` of the remote list; the lists may then differ in length.
    """

    num_tokens: int
    local_skip: int = 0
    remote_skip: int = 0


@dataclass(frozen=True)
class PullItem:
    """One pull of a :meth:`AsyncClient.pull_batch`: the arguments :meth:`AsyncClient.pull` takes."""

    request_id: str
    remote_addresses: Sequence[str]
    local_blocks: BlockMap
    remote_blocks: BlockMap | None = None
    remote_engine_id: str = ""
    wait: bool = True
    deadline: float | None = None
    spans: Mapping[str, TokenSpan] | None = None
    #: Push mode: the source ranks WRITE into ``local_blocks`` once the request is published there.
    push: bool = False


@dataclass(frozen=True)
class CompletionEvent:
    """One event of the completion stream."""

    sequence: int
    kind: str  # PULLED, PULL_FAILED, RELEASED, EXPIRED, ABORTED
    request_id: str
    transfer_id: str
    code: grpc.StatusCode
    message: str
    peer: str
    bytes: int = 0
    descriptors: int = 0
    duration_seconds: float = 0.0
    unix_ms: int = 0
    raw: Any = field(default=None, repr=False, compare=False)


def normalize_target(target: str) -> str:
    """``/path/sock`` or ``unix:/path`` -> ``unix:///path``; ``host:port`` unchanged."""
    if target.startswith("unix://"):
        return target
    if target.startswith("unix:"):
        return "unix://" + target[5:]
    if target.startswith("/"):
        return "unix://" + target
    return target


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def _groups_proto(groups: GroupsArg) -> list[local_pb2.CacheGroup]:
    specs = [CacheGroupSpec(n, lay, mem) for n, (lay, mem) in groups.items()] if isinstance(groups, Mapping) else groups
    return [
        local_pb2.CacheGroup(name=g.name, layout=layout_to_proto(g.layout), memory=memory_to_proto(g.memory))
        for g in specs
    ]


def _spans(spans: Mapping[str, TokenSpan] | None, *, local: bool) -> dict[str, tuple[int, int]]:
    """(skip_tokens, num_tokens) per group of one side of a pull (num_tokens is the local side's)."""
    return {g: (s.local_skip, s.num_tokens) if local else (s.remote_skip, 0) for g, s in (spans or {}).items()}


def _pull_result(resp: local_pb2.PullResponse) -> PullResult:
    st = resp.stats
    return PullResult(
        resp.transfer_id, resp.request_id, resp.done, st.bytes, st.descriptors, st.duration_seconds,
        st.data_seconds, tuple(st.remote_ranks), tuple(st.warnings), st.fetch_seconds,
    )  # fmt: skip


def _event(ev: local_pb2.Completion) -> CompletionEvent:
    return CompletionEvent(
        ev.sequence, local_pb2.Completion.Kind.Name(ev.kind), ev.request_id, ev.transfer_id,
        status_code(ev.code), ev.message, ev.peer, ev.stats.bytes, ev.stats.descriptors, ev.stats.duration_seconds,
        ev.unix_ms, ev,
    )  # fmt: skip


def _pull_request(item: PullItem, method: str = "Pull") -> local_pb2.PullRequest:
    """The PullRequest of ``item``; raises INVALID_ARGUMENT (as the sidecar would) for arguments it cannot carry."""
    if item.spans and not item.remote_blocks and not item.push:
        raise KvxferRpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"spans: name remote_blocks too when moving part of a group's tokens (spans of {sorted(item.spans)})",
            method, reason=Reason.INVALID_FIELD, field="spans",
        )  # fmt: skip
    if item.deadline is not None and not (math.isfinite(item.deadline) and item.deadline > 0):
        # 0 would go as timeout_seconds 0, which means the sidecar's own default: refused as < 0 is.
        raise KvxferRpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"deadline: must be a finite number of seconds > 0 (None: the sidecar's --transfer-timeout-seconds), "
            f"got {item.deadline}", method, reason=Reason.INVALID_FIELD, field="deadline",
        )  # fmt: skip
    remote = item.remote_blocks
    if remote is None and item.push and item.spans:
        remote = {g: [] for g in item.spans}  # push: the writer's ids are its publish; only the skip is named
    return local_pb2.PullRequest(
        request_id=item.request_id, remote_engine_id=item.remote_engine_id,
        remote_addresses=list(item.remote_addresses),
        remote_blocks=blocks_to_proto(remote or {}, _spans(item.spans, local=False)),
        local_blocks=blocks_to_proto(item.local_blocks, _spans(item.spans, local=True)), wait=item.wait,
        timeout_seconds=0.0 if item.deadline is None else item.deadline, push=item.push,
    )  # fmt: skip


def _publish_request(
    request_id: str, blocks: BlockMap, lease_seconds: float, reader_engine_id: str, origins: Mapping[str, int] | None
) -> local_pb2.PublishRequest:
    spans = {g: (int(t), 0) for g, t in (origins or {}).items()}
    return local_pb2.PublishRequest(
        request_id=request_id, blocks=blocks_to_proto(blocks, spans), lease_seconds=lease_seconds,
        reader_engine_id=reader_engine_id,
    )  # fmt: skip


def _batch_results(resp: local_pb2.PullBatchResponse) -> list[PullResult | KvxferRpcError]:
    out: list[PullResult | KvxferRpcError] = []
    for r in resp.results:
        if r.code == 0:
            out.append(_pull_result(r.response))
            continue
        code = status_code(r.code)
        reason = parse_reason(r.reason, code)
        out.append(KvxferRpcError(code, r.message, "PullBatch", reason=reason, field=r.field or None))
    return out


def _check_timeout(value: float) -> float:
    """A client's default deadline: a finite number of seconds > 0."""
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"timeout: must be a finite number of seconds > 0, got {value}", field="timeout")
    return value


def _status_dict(resp: Any) -> dict[str, Any]:
    out = {}
    for f in resp.DESCRIPTOR.fields:
        value = getattr(resp, f.name)
        out[f.name] = value if isinstance(value, str | bytes | int | float | bool) else list(value)
    return out
