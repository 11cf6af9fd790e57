"""Checks of what callers send, before anything is changed: each names the field and the value.

Workers and peers are checked alike: a value that fails here leaves every other request as it was.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.addresses import parse_address
from kvxfer.errors import ConfigError, InvalidArgumentError, KvxferError
from kvxfer.layout import CacheKind, KVCacheLayout, head_range
from kvxfer.topology import RankInfo
from kvxfer.wire import common_pb2, peer_pb2
from kvxfer.wire.convert import check_block_ids, ids_array

__all__ = [
    "NOTICE_OUTCOMES",
    "TokenSpans",
    "check_addresses",
    "check_drain_timeout",
    "check_lease",
    "check_outcome",
    "check_peer_address",
    "check_rank_heads",
    "check_timeout",
    "not_published",
    "remote_blocks",
    "token_spans",
]

I64 = npt.NDArray[np.int64]
#: Per group: (tokens to move or None for all, local skip, remote skip) (see BlockList in common.proto).
TokenSpans = dict[str, tuple[int | None, int, int]]
MAX_LEASE_SECONDS = 86400.0


def check_rank_heads(layout: KVCacheLayout, rank: RankInfo, field: str) -> None:
    """A layout's head count must be what its rank holds of the model's heads."""
    if layout.kind in (CacheKind.MLA, CacheKind.MAMBA):
        return
    try:
        h0, h1 = head_range(layout.total_kv_heads, rank.tp_size, rank.tp_rank)
    except KvxferError as exc:
        # The head count does not split over the rank's TP size: the layout's total, or the rank's size.
        where = f"{field}.total_kv_heads" if exc.field == "total_kv_heads" else f"rank.{exc.field}"
        raise InvalidArgumentError(f"{where}: {exc.message.split(': ', 1)[-1]}", field=where) from None
    if h1 - h0 != layout.num_kv_heads:
        raise InvalidArgumentError(
            f"{field}.num_kv_heads: rank {rank.tp_rank}/{rank.tp_size} holds {h1 - h0} of {layout.total_kv_heads} "
            f"heads, the layout says {layout.num_kv_heads}",
            field=f"{field}.num_kv_heads",
        )


def check_addresses(values: Iterable[str]) -> list[str]:
    """Peer API addresses of remote ranks: each one a host and port that can be dialled, none twice.

    Checked here, before any connection is tried, so that a malformed address (port 0, no host, a
    wildcard, a Unix socket path) is the caller's INVALID_ARGUMENT, not a peer's UNAVAILABLE.
    """
    addresses = list(values)
    for i, a in enumerate(addresses):
        check_peer_address(a, f"remote_addresses[{i}]")
    if len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(
            f"remote_addresses: an address appears twice in {addresses}", field="remote_addresses"
        )
    return addresses


def check_peer_address(value: str, field: str) -> str:
    """A peer API address to dial (``host:port``, ``[v6]:port``): INVALID_ARGUMENT naming ``field`` otherwise."""
    if _dialable(value):
        return value
    try:
        parse_address(value, setting=field, dial=True)
    except ConfigError as exc:
        raise InvalidArgumentError(exc.message, field=exc.field) from None
    return value


@functools.lru_cache(maxsize=1024)
def _dialable(value: str) -> bool:
    """Whether ``value`` is an address to dial; remembered, since every pull names the same few peers."""
    try:
        parse_address(value, dial=True)
    except ConfigError:
        return False
    return True


def check_lease(value: float) -> float:
    """A publish's lease in seconds: 0 (the sidecar's default) up to a day."""
    if not math.isfinite(value) or value < 0 or value > MAX_LEASE_SECONDS:
        raise InvalidArgumentError(
            f"lease_seconds: must be in [0, {MAX_LEASE_SECONDS:g}], got {value}", field="lease_seconds"
        )
    return value


def check_timeout(value: float) -> float:
    """A pull's timeout in seconds: 0 (the sidecar's default) or more."""
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(
            f"timeout_seconds: must be a finite number >= 0 (0: the sidecar's --transfer-timeout-seconds), got {value}",
            field="timeout_seconds",
        )
    return value


def check_drain_timeout(value: float, drain_seconds: float) -> float:
    """A Drain's budget in seconds: 0 (``drain_seconds``, the sidecar's --drain-seconds) up to ``drain_seconds``.

    A Drain may shorten the budget the deployment gave the sidecar, not extend it: the deployment
    sized its shutdown window (Kubernetes' terminationGracePeriodSeconds) for --drain-seconds.
    """
    if not math.isfinite(value) or not 0 <= value <= drain_seconds:
        raise InvalidArgumentError(
            f"timeout_seconds: must be in [0, {drain_seconds:g}] (0: the sidecar's --drain-seconds, "
            f"{drain_seconds:g}s; a Drain may shorten the budget, not extend it), got {value}",
            field="timeout_seconds",
        )
    return value


#: The outcomes a Notify may carry (``OUTCOME_UNSPECIFIED`` and numbers the proto does not define are refused).
NOTICE_OUTCOMES = frozenset({peer_pb2.NotifyRequest.DONE, peer_pb2.NotifyRequest.FAILED, peer_pb2.NotifyRequest.UNREAD})


def check_outcome(value: int, field: str = "outcome") -> int:
    """A Notify's outcome: DONE, FAILED or UNREAD (a missing one must not read as DONE and free the blocks)."""
    if value not in NOTICE_OUTCOMES:
        names = ", ".join(f"{peer_pb2.NotifyRequest.Outcome.Name(v)} ({v})" for v in sorted(NOTICE_OUTCOMES))
        raise InvalidArgumentError(f"{field}: {value} is not one of {names}", field=field)
    return value


def remote_blocks(
    lists: Sequence[common_pb2.BlockList], layouts: Mapping[str, KVCacheLayout], *, push: bool = False,
    field: str = "remote_blocks",
) -> dict[str, I64]:  # fmt: skip
    """The published ids a pull names per group (checked against the publish once it is fetched).

    With ``push`` a list without ids names only a skip (the writer's published ids are not known yet).
    """
    out: dict[str, I64] = {}
    given: set[str] = set()
    for i, bl in enumerate(lists):
        if bl.group not in layouts:
            raise InvalidArgumentError(
                f"{field}[{i}].group: unknown cache group {bl.group!r}; registered: {', '.join(layouts)}",
                field=f"{field}[{i}].group",
            )
        if bl.group in given:  # a second list would silently replace the first
            raise InvalidArgumentError(f"{field}[{i}].group: cache group {bl.group!r} given twice",
                                       field=f"{field}[{i}].group")  # fmt: skip
        given.add(bl.group)
        if push and not bl.block_ids:
            continue
        ids = ids_array(bl.block_ids)
        out[bl.group] = check_block_ids(ids, 2**62, f"{field}[{bl.group}]")
    return out


def token_spans(local: Sequence[common_pb2.BlockList], remote: Sequence[common_pb2.BlockList]) -> TokenSpans:
    """Per group: (tokens to move or None for all, local skip, remote skip) from the block lists."""
    remote_skip = {bl.group: int(bl.skip_tokens) for bl in remote}
    out: TokenSpans = {}
    for bl in local:
        skip_r = remote_skip.get(bl.group, 0)
        if bl.num_tokens or bl.skip_tokens or skip_r:
            out[bl.group] = (int(bl.num_tokens) or None, int(bl.skip_tokens), skip_r)
    return out


def not_published(given: I64, published: I64) -> str:
    """'' when every id of ``given`` was published, else which one was not."""
    if given.shape == published.shape and bool((given == published).all()):
        return ""  # the usual case, the very list published: no set lookup
    outside = np.flatnonzero(~np.isin(given, published))
    if not outside.size:
        return ""
    i = int(outside[0])
    more = f" ({outside.size} ids in all)" if outside.size > 1 else ""
    return f"block id {int(given[i])} at position {i} was not published{more}"
