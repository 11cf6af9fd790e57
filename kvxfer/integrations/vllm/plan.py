"""What the scheduler side tells the workers each step, and which blocks of which group a request moves.

Everything here is plain data and arithmetic on block tables (no vLLM, no I/O), so that the
rules - which blocks a prefill publishes per KV-cache group, which of them a decode instance
reads into which of its own blocks - are tested on their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvxfer.client.types import TokenSpan
from kvxfer.errors import InvalidArgumentError
from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.params import RemoteGroup, RemotePrefill

__all__ = [
    "NULL_BLOCK",
    "GroupPull",
    "PullArguments",
    "PullSpec",
    "StepPlan",
    "StreamSpec",
    "attended_from",
    "attention_span",
    "group_offer",
    "group_pull",
    "published_blocks",
    "pull_arguments",
    "stage_addresses",
]

#: vLLM's null block: a table entry that holds nothing (a sliding window's skipped blocks).
NULL_BLOCK = 0


@dataclass(frozen=True)
class GroupPull:
    """One group of a pull: local blocks that receive the remote ones (tokens as in ``TokenSpan``)."""

    group: int  # vLLM transfer group index
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    num_tokens: int = 0  # 0: the lists cover the same tokens and all of them move (state groups)
    local_skip: int = 0
    remote_skip: int = 0


@dataclass(frozen=True)
class PullSpec:
    """Load one request's prompt KV from the prefill instance into local blocks, every group at once."""

    request_id: str
    remote: RemotePrefill | None
    groups: tuple[GroupPull, ...] = ()
    #: Set when the load cannot even start (the worker reports it failed at once).
    error: str = ""
    #: Push mode: the prefill side WRITEs (``remote_blocks`` are empty; ``remote_skip`` is a request position).
    push: bool = False

    @property
    def local_blocks(self) -> tuple[int, ...]:
        """Every local block the pull writes (all groups)."""
        return tuple(b for g in self.groups for b in g.local_blocks)


@dataclass(frozen=True)
class StreamSpec:
    """Layer-wise push: one request this step computes, with its blocks so far (per transfer group)."""

    request_id: str  # the id it is published under
    #: Per transfer group: the blocks that hold tokens (a sliding window's tail), and the position of the first.
    groups: tuple[tuple[tuple[int, ...], int], ...]
    start: int  # tokens computed before the step
    end: int  # tokens computed after it
    reader: str = ""  # the decode engine its publish will be bound to (kvxfer_reader_engine_id; "": any)


@dataclass
class StepPlan:
    """Connector work of one engine step."""

    #: Loads to start (decode side).
    pulls: list[PullSpec] = field(default_factory=list)
    #: Requests whose loads must stop: finished (aborted) while their KV was still arriving.
    aborts: list[str] = field(default_factory=list)
    #: Requests this (prefill) instance published, with their lease expiry in unix ms.
    published: dict[str, int] = field(default_factory=dict)
    #: Published under another id than vLLM's (push mode: the proxy's ``kvxfer_push_id``): vLLM id -> that id.
    publish_ids: dict[str, str] = field(default_factory=dict)
    #: Prefill-side copies this (decode) instance will not read (its prefix cache covered the
    #: prompt, or it computes the prompt itself): their publishers are told to free them now.
    drops: list[RemotePrefill] = field(default_factory=list)

    #: Requests this (prefill) step computes whose KV streams layer by layer (push mode).
    streams: list[StreamSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pulls or self.aborts or self.published or self.drops or self.streams)


def published_blocks(group: TransferGroup, table: Sequence[int], num_tokens: int) -> RemoteGroup | None:
    """The blocks of one group a prefill publishes for a request whose first ``num_tokens`` are computed.

    Full attention: every block of those tokens. Sliding window: the blocks the window still
    covers (vLLM frees the others, leaving null blocks in the table). Mamba: the running-state
    block (the trailing speculative scratch blocks are not state). None: nothing to publish.
    """
    if group.role == "state":
        real = [b for b in table if b != NULL_BLOCK]
        if not real:
            return None
        # Drop the speculative scratch slots vLLM appends after the running state.
        keep = len(table) - min(group.spec_blocks, len(table) - 1)
        pos = max(i for i in range(keep) if table[i] != NULL_BLOCK)
        segments = group.segments if group.tp_split else None
        return RemoteGroup(group.name, (table[pos],), group.block_size, pos, group.tp_split, segments)
    used = min(len(table), math.ceil(num_tokens / group.block_size))
    first = max(0, used - group.window_blocks) if group.role == "window" else 0
    while first < used and table[first] == NULL_BLOCK:
        first += 1
    ids = tuple(table[first:used])
    if not ids or NULL_BLOCK in ids:
        return None
    return RemoteGroup(group.name, ids, group.block_size, first)


def attended_from(group: TransferGroup, computed: int) -> int:
    """The first token the next token attends to once ``computed`` tokens are in the cache, as vLLM's
    managers' ``get_num_skipped_tokens`` count it (both sides drop the blocks wholly before it):
    a sliding window reaches back ``window - 1`` tokens, chunked local attention to the start of
    the next token's chunk, every other group to the first token."""
    if group.role == "window":
        return max(0, computed - group.window + 1)
    if group.role == "chunked":
        return computed // group.chunk * group.chunk
    return 0


def attention_span(group: TransferGroup) -> str:
    """How a group that drops its early blocks limits attention, in words."""
    if group.role == "chunked":
        return f"the local-attention chunk of {group.chunk} tokens"
    return f"the sliding window of {group.window} tokens"


def group_pull(
    group: TransferGroup, remote: RemoteGroup, table: Sequence[int], start: int, end: int
) -> GroupPull | str | None:
    """Which local blocks of ``table`` receive which published blocks, for tokens ``[start, end)``.

    ``start`` is where the local prefix cache stops (a multiple of the local block size), ``end``
    the tokens the decode instance loads. Returns the pull, a reason why this group cannot be
    loaded, or None when it has nothing to load.
    """
    if group.role == "state":
        real = published_blocks(group, table, end)
        if real is None:
            return "no state block is allocated for the request"
        if len(remote.block_ids) != 1:
            return f"the prefill side published {len(remote.block_ids)} state blocks, not 1"
        return GroupPull(group.index, real.block_ids, remote.block_ids[:1])
    bl, br = group.block_size, remote.block_size or group.block_size
    if max(bl, br) % min(bl, br):
        return f"block size {br} on the prefill side and {bl} here: neither is a multiple of the other"
    g = min(bl, br)
    first_local = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
    s = max(start, remote.first_block * br, first_local * bl)
    if group.role in ("window", "chunked"):
        # Tokens before the window (chunk) are never attended again: skip what either side already dropped.
        need = max(start, attended_from(group, end))
        if s > need:
            return (
                f"{attention_span(group)} needs tokens from {need}; blocks from token {s} are published and allocated"
            )
    elif s > start:
        return f"tokens from {start} are needed; the prefill side published blocks from token {s}"
    s = -(-s // g) * g
    if s >= end:
        return None
    e2 = s + -(-(end - s) // g) * g  # whole chunks move
    local = tuple(table[s // bl : -(-e2 // bl)])
    lo_r, hi_r = s // br - remote.first_block, -(-e2 // br) - remote.first_block
    if hi_r > len(remote.block_ids):
        return f"the prefill side published {len(remote.block_ids)} blocks; tokens up to {end} need {hi_r}"
    if len(local) != -(-e2 // bl) - s // bl or NULL_BLOCK in local:
        return f"local blocks for tokens [{s}, {end}) are not all allocated"
    return GroupPull(group.index, local, tuple(remote.block_ids[lo_r:hi_r]), end - s, s % bl, s % br)


def group_offer(group: TransferGroup, table: Sequence[int], start: int, end: int) -> GroupPull | str | None:
    """Push mode: which local blocks of ``table`` the prefill side writes, for tokens ``[start, end)``.

    As :func:`group_pull`, before anything is published: the returned pull has no remote blocks,
    and its ``remote_skip`` is the request position where the move starts (the writer knows where
    its own publish starts). State groups move their one block whole.
    """
    if group.role == "state":
        real = published_blocks(group, table, end)
        if real is None:
            return "no state block is allocated for the request"
        return GroupPull(group.index, real.block_ids, ())
    # Planned as a pull from a publish of this side's block size that starts at token 0.
    whole = RemoteGroup(group.name, tuple(range(-(-end // group.block_size) + 1)), group.block_size)
    got = group_pull(group, whole, table, start, end)
    if not isinstance(got, GroupPull):
        return got
    at = got.remote_blocks[0] * group.block_size + got.remote_skip
    return GroupPull(got.group, got.local_blocks, (), got.num_tokens, got.local_skip, at)


@dataclass(frozen=True)
class PullArguments:
    """A pull's blocks and token spans by sidecar group, as one rank's worker names them in its Pull."""

    local_blocks: dict[str, tuple[int, ...]]
    remote_blocks: dict[str, tuple[int, ...]] | None  # None in push mode: the writer's ids are its publish
    spans: dict[str, TokenSpan]


def pull_arguments(spec: PullSpec, names_of: Callable[[int], Sequence[str]]) -> PullArguments:
    """What a rank's worker sends for ``spec``; ``names_of``: the sidecar groups of a vLLM transfer group.

    The decode scheduler's Prepare names the same (kvxfer.server.prepared), so both come from here.
    """
    local: dict[str, tuple[int, ...]] = {}
    remote: dict[str, tuple[int, ...]] = {}
    spans: dict[str, TokenSpan] = {}
    for gp in spec.groups:
        for name in names_of(gp.group):
            local[name] = gp.local_blocks
            if not spec.push:
                remote[name] = gp.remote_blocks
            if gp.num_tokens:
                spans[name] = TokenSpan(gp.num_tokens, gp.local_skip, gp.remote_skip)
    return PullArguments(local, remote or None, spans)


def stage_addresses(addresses: Sequence[str], pp_rank: int, pp_size: int) -> list[str]:
    """The prefill sidecars a rank of pipeline stage ``pp_rank`` reads: its stage's tensor-parallel ranks.

    ``kvxfer_addresses`` lists every prefill rank, pipeline stage by stage.
    """
    if len(addresses) % pp_size:
        raise InvalidArgumentError(
            f"kvxfer_addresses: {len(addresses)} prefill sidecars do not split into {pp_size} pipeline stages",
            field="kvxfer_addresses",
        )
    per = len(addresses) // pp_size
    return list(addresses[pp_rank * per : (pp_rank + 1) * per])
