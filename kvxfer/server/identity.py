"""Who a sidecar is (the handshake's content) and whether two sidecars can exchange blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvxfer import PROTOCOL_VERSION
from kvxfer.errors import InvalidArgumentError, KvxferError, LayoutError, TopologyError
from kvxfer.layout import CacheKind, KVCacheLayout, head_range
from kvxfer.server.validation import check_peer_address
from kvxfer.topology import RankInfo, RegionTable, TransferTopology
from kvxfer.wire import peer_pb2
from kvxfer.wire.convert import (
    check_id,
    layout_from_proto,
    layout_to_proto,
    rank_from_proto,
    rank_to_proto,
    regions_from_proto,
    regions_to_proto,
)

__all__ = [
    "DIFFERENCES_BYTES",
    "MAX_GROUPS",
    "Identity",
    "check_group_count",
    "describe_differences",
    "reader_differences",
    "remote_sources",
]

#: Cache groups one registration or handshake may name: far above any model's (vLLM's hybrid models
#: have a handful), and low enough that checking two sidecars' groups against each other stays cheap.
MAX_GROUPS = 256
#: UTF-8 bytes of differences a refused handshake's message lists; the rest are counted. The message
#: travels in gRPC's trailing metadata twice (``grpc-message``, percent-encoded, and the status
#: details, base64), which a client refuses beyond 16 KiB (RESOURCE_EXHAUSTED in place of the refusal).
DIFFERENCES_BYTES = 1024


@dataclass(frozen=True)
class Identity:
    """A sidecar as its handshake describes it."""

    protocol_version: int
    engine_id: str
    instance_id: str
    epoch: int
    rank: RankInfo
    groups: Mapping[str, KVCacheLayout]
    backend: str
    agent_name: str
    metadata: bytes
    address: str
    role: str
    #: Per group: its registered regions and memory type (what a reader needs to READ before the
    #: lookup answers); empty from a peer that does not send them.
    regions: Mapping[str, tuple[RegionTable, str]] = dataclasses.field(default_factory=dict, compare=False)
    #: Where the peer API's hot calls are also served as frames ("": gRPC only; see kvxfer.server.peers).
    frames_address: str = dataclasses.field(default="", compare=False)

    @property
    def label(self) -> str:
        """``engine[tp r/n]`` for messages."""
        return f"{self.engine_id}[tp {self.rank.tp_rank}/{self.rank.tp_size}]"

    def to_proto(self) -> peer_pb2.PeerInfo:
        """The PeerInfo message."""
        return peer_pb2.PeerInfo(
            protocol_version=self.protocol_version, engine_id=self.engine_id, instance_id=self.instance_id,
            epoch=self.epoch, rank=rank_to_proto(self.rank),
            groups=[
                peer_pb2.GroupLayout(
                    name=n, layout=layout_to_proto(lay),
                    regions=regions_to_proto(self.regions[n][0]) if n in self.regions else [],
                    memory_type=self.regions[n][1] if n in self.regions else "",
                )
                for n, lay in self.groups.items()
            ],
            data_plane=peer_pb2.DataPlane(backend=self.backend, agent_name=self.agent_name, metadata=self.metadata),
            address=self.address, role=self.role, frames_address=self.frames_address,
        )  # fmt: skip

    @classmethod
    def from_proto(cls, msg: peer_pb2.PeerInfo, field: str = "info") -> Identity:
        """Parse and validate a PeerInfo message."""
        check_id(msg.engine_id, f"{field}.engine_id")
        check_id(msg.instance_id, f"{field}.instance_id")
        check_group_count(len(msg.groups), f"{field}.groups")
        groups: dict[str, KVCacheLayout] = {}
        regions: dict[str, tuple[RegionTable, str]] = {}
        for i, g in enumerate(msg.groups):
            check_id(g.name, f"{field}.groups[{i}].name")
            if g.name in groups:
                raise InvalidArgumentError(f"{field}.groups[{i}].name: group {g.name!r} given twice", field=field)
            groups[g.name] = layout_from_proto(g.layout, f"{field}.groups[{g.name}].layout")
            if g.regions:
                try:
                    table = regions_from_proto(g.regions, groups[g.name], f"{field}.groups[{g.name}].regions")
                except InvalidArgumentError:
                    continue  # not usable ahead of a lookup: a reader waits for GetPublished, which checks them
                regions[g.name] = (table, "VRAM" if g.memory_type == "VRAM" else "DRAM")
        # The publisher dials this address to tell the reader of aborts: refuse one nobody can dial now.
        check_peer_address(msg.address, f"{field}.address")
        return cls(
            int(msg.protocol_version), msg.engine_id, msg.instance_id, int(msg.epoch),
            rank_from_proto(msg.rank, f"{field}.rank"), groups, msg.data_plane.backend, msg.data_plane.agent_name,
            bytes(msg.data_plane.metadata), msg.address, msg.role, regions, msg.frames_address,
        )  # fmt: skip


def check_group_count(n: int, field: str) -> None:
    """Refuse more than :data:`MAX_GROUPS` cache groups (INVALID_ARGUMENT naming ``field``)."""
    if n > MAX_GROUPS:
        raise InvalidArgumentError(f"{field}: {n} cache groups; at most {MAX_GROUPS}", field=field)


def describe_differences(diffs: Sequence[str], budget: int = DIFFERENCES_BYTES) -> str:
    """``diffs`` joined by ``"; "``, the first ones up to ``budget`` UTF-8 bytes, then how many were left out."""
    shown: list[str] = []
    used = 0
    for d in diffs:
        size = len(d.encode())
        if used + size > budget:
            if not shown:  # one difference longer than the budget: its start
                shown.append(d.encode()[:budget].decode(errors="ignore") + "...")
            break
        shown.append(d)
        used += size + 2
    left = len(diffs) - len(shown)
    text = "; ".join(shown)
    return f"{text}; and {left} more difference{'s' if left > 1 else ''}" if left else text


def _rank_view(layout: KVCacheLayout, local_tp: int, tp_size: int) -> KVCacheLayout:
    """``layout`` (of a ``local_tp``-way split) as a rank of a ``tp_size``-way split holds it (head
    count per rank, or a mamba page's segment sizes).

    Only the heads matter to which ranks are read: the local rank's padding (``page_stride``,
    ``block_bytes``) is sized for its own pages and would not fit a rank holding more heads.
    """
    if layout.kind is CacheKind.MAMBA:
        try:
            return layout.resharded(local_tp, tp_size)
        except LayoutError as exc:
            raise TopologyError(exc.message, field=exc.field) from None
    if layout.kind is CacheKind.MLA:
        return layout
    h0, h1 = head_range(layout.total_kv_heads, tp_size, 0)
    return dataclasses.replace(layout, num_kv_heads=h1 - h0, page_stride=0, block_bytes=0)


def remote_sources(local: KVCacheLayout, local_rank: RankInfo, remote_tp: int) -> set[int]:
    """Remote TP ranks the local rank reads for one group, from the local layout alone.

    Which ranks hold which heads depends only on the kind, the total head count and the TP sizes,
    so this works before any remote layout is known (it picks the ranks to handshake with).
    """
    remote = _rank_view(local, local_rank.tp_size, remote_tp)
    topo = TransferTopology(local, remote, local_rank, remote_tp, local_rank.pp_size)
    return {s.remote_rank for s in topo.sources()}


def reader_differences(reader: Identity, publisher: Identity) -> list[str]:
    """Every reason ``reader`` cannot read from ``publisher`` ("local" = the reader in layout diffs)."""
    diffs: list[str] = []
    if reader.protocol_version != publisher.protocol_version:
        diffs.append(f"protocol_version: reader {reader.protocol_version}, publisher {publisher.protocol_version}")
    if reader.protocol_version != PROTOCOL_VERSION and publisher.protocol_version != PROTOCOL_VERSION:
        diffs.append(f"protocol_version: neither side speaks this build's version {PROTOCOL_VERSION}")
    if reader.backend != publisher.backend:
        diffs.append(f"backend: reader {reader.backend}, publisher {publisher.backend}")
    if publisher.role == "decode":
        diffs.append(f"role: {publisher.label} is a decode-only sidecar; it publishes nothing")
    if reader.role == "prefill":
        diffs.append(f"role: {reader.label} is a prefill-only sidecar; it does not pull")
    if reader.rank.pp_size != publisher.rank.pp_size:
        diffs.append(f"pp_size: reader {reader.rank.pp_size}, publisher {publisher.rank.pp_size}")
    elif reader.rank.pp_rank != publisher.rank.pp_rank:
        diffs.append(
            f"pp_rank: reader {reader.rank.pp_rank}, publisher {publisher.rank.pp_rank} (a rank reads from the "
            "same pipeline stage)"
        )
    # In each side's own order (a set's would change from run to run).
    diffs.extend(f"cache group {name!r}: registered by the reader, not by the publisher"
                 for name in reader.groups if name not in publisher.groups)  # fmt: skip
    diffs.extend(f"cache group {name!r}: registered by the publisher, not by the reader"
                 for name in publisher.groups if name not in reader.groups)  # fmt: skip
    for name, local in reader.groups.items():
        remote = publisher.groups.get(name)
        if remote is None:
            continue
        layout_diffs = local.incompatibilities(remote)
        diffs.extend(f"group {name!r}: {d}" for d in layout_diffs)
        if layout_diffs or reader.rank.pp_size != publisher.rank.pp_size:
            continue
        try:
            TransferTopology(local, remote, reader.rank, publisher.rank.tp_size, publisher.rank.pp_size)
        except KvxferError as exc:
            diffs.append(f"group {name!r}: {exc.message}")
    return list(dict.fromkeys(diffs))  # each once, in order (linear: a peer may name many groups)
