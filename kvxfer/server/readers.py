"""The reader sidecars that handshook with this one (prefill side), and which of their ranks read here.

A reader handshakes (peer ``Handshake``) before it may look a publish up, hold it, be offered into
or notify about it: :meth:`Readers.handshake` refuses impostors (the engine id its credentials
name), readers claiming more than :data:`MAX_TP_SIZE` ranks, and readers whose layouts cannot read
from this sidecar (every difference listed), and remembers the others rank by rank. The table is
bounded: a peer must not grow it without limit (each entry holds its data-plane metadata), so at
most :data:`READERS_PER_ENGINE` ranks of one engine and :data:`READERS_KEPT` in all are kept, the
longest unused forgotten first; a forgotten reader is refused NOT_HANDSHAKEN and handshakes again.

:func:`expected_readers` works out which TP ranks of a reader read from this rank: who must confirm
a publish before its blocks are freed (:class:`~kvxfer.server.publisher.Publisher`).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvxfer.errors import FailedPreconditionError, InvalidArgumentError, KvxferError, Reason
from kvxfer.logs import get_logger
from kvxfer.metrics import SidecarMetrics
from kvxfer.server.identity import Identity, describe_differences, reader_differences
from kvxfer.server.peer_auth import ANONYMOUS, PeerCredentials
from kvxfer.server.registration import Registry
from kvxfer.server.state import ReaderKey, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.topology import RankInfo
from kvxfer.wire import peer_pb2

__all__ = ["MAX_TP_SIZE", "READERS_KEPT", "READERS_PER_ENGINE", "Readers", "expected_readers"]

log = get_logger("kvxfer.server")
#: The largest TP size a reader's handshake may claim (its expected readers are worked out rank by rank).
MAX_TP_SIZE = 256
#: Reader ranks kept per engine id (one per rank of its live instance, and a restarting one's): the
#: longest unused is forgotten first (that reader handshakes again when it is next refused).
READERS_PER_ENGINE = 2 * MAX_TP_SIZE
#: Reader ranks kept in all, every engine together; the longest unused is forgotten first.
READERS_KEPT = 4096


class Readers:
    """The reader ranks that handshook with this sidecar, the longest unused first (see the module docs)."""

    def __init__(self, registry: Registry, metrics: SidecarMetrics) -> None:
        self.registry = registry
        self.metrics = metrics
        #: Sidecars that handshook us, the longest unused first (see _add for the bounds). Read it
        #: freely (the pusher does); change it only through this class, which keeps the indexes below.
        self.ranks: dict[ReaderKey, Identity] = {}
        self._by_engine: dict[str, dict[ReaderKey, None]] = {}  # engine id -> its keys in ranks, oldest first
        self._instances: dict[tuple[str, str], int] = {}  # (engine id, instance id) -> its keys in ranks

    def __iter__(self) -> Iterator[ReaderKey]:
        """The reader ranks kept, the longest unused first."""
        return iter(self.ranks)

    def handshake(
        self, req: peer_pb2.HandshakeRequest, creds: PeerCredentials = ANONYMOUS
    ) -> peer_pb2.HandshakeResponse:
        """Refuse impostors and incompatible readers (every difference listed); remember the others."""
        try:
            reader = Identity.from_proto(req.info, "info")
            creds.check(reader.engine_id, "info.engine_id")
            if reader.rank.tp_size > MAX_TP_SIZE:
                raise InvalidArgumentError(
                    f"info.rank.tp_size: {reader.rank.tp_size} is more than the {MAX_TP_SIZE} ranks a reader may have",
                    field="info.rank.tp_size",
                )
        except KvxferError:
            self.metrics.handshakes.labels(outcome="failed").inc()
            raise
        me = self.registry.identity()
        diffs = reader_differences(reader, me)
        if diffs:
            self.metrics.handshakes.labels(outcome="refused").inc()
            listed = describe_differences(diffs)
            log.warning("handshake refused", extra={"peer": reader.label, "differences": listed})
            raise FailedPreconditionError(
                f"incompatible peer: {reader.label} cannot read from {me.label} (local = the reader, remote = this "
                "sidecar): " + listed,
                field="info", reason=Reason.INCOMPATIBLE_PEER,
            )  # fmt: skip
        self._add((reader.engine_id, reader.instance_id, reader.rank.tp_rank, reader.rank.pp_rank), reader)
        self.metrics.handshakes.labels(outcome="ok").inc()
        return peer_pb2.HandshakeResponse(info=me.to_proto())

    def _add(self, key: ReaderKey, reader: Identity) -> None:
        """Remember a reader rank that handshook, as the newest; forget what it replaces and what is too many.

        A restarted reader gets a new instance id: its old instance at this rank is forgotten. At
        most :data:`READERS_PER_ENGINE` ranks of one engine and :data:`READERS_KEPT` in all are kept,
        the longest unused going first (a lookup, a Hold or an Offer counts as use, see
        :meth:`use`), so no peer can grow the table (each entry holds its data-plane metadata)
        without bound, and a reader in use is not forgotten for the readers that came and went since
        its handshake (decode pods replaced under new engine ids).
        """
        self.forget(key)
        same_rank = [k for k in self._by_engine.get(key[0], ()) if k[2:] == key[2:]]
        for old in same_rank:
            self.forget(old)
        self.ranks[key] = reader
        ranks = self._by_engine.setdefault(key[0], {})
        ranks[key] = None
        self._instances[key[:2]] = self._instances.get(key[:2], 0) + 1
        while len(ranks) > READERS_PER_ENGINE:
            self.forget(next(iter(ranks)))
        while len(self.ranks) > READERS_KEPT:
            self.forget(next(iter(self.ranks)))

    def use(self, key: ReaderKey) -> Identity | None:
        """The handshaken reader rank ``key``, now the last to be forgotten; None if it is not known."""
        reader = self.ranks.pop(key, None)
        if reader is not None:
            self.ranks[key] = reader  # dicts keep insertion order: last in, last out
            ranks = self._by_engine[key[0]]
            del ranks[key]
            ranks[key] = None
        return reader

    def forget(self, key: ReaderKey) -> None:
        """Forget the reader rank ``key`` (nothing if it is not known)."""
        if self.ranks.pop(key, None) is None:
            return
        ranks = self._by_engine[key[0]]
        del ranks[key]
        if not ranks:
            del self._by_engine[key[0]]
        left = self._instances.pop(key[:2]) - 1
        if left:
            self._instances[key[:2]] = left

    def knows(self, engine_id: str, instance_id: str) -> bool:
        """True when that sidecar instance handshook with this one."""
        return (engine_id, instance_id) in self._instances

    def count_instances(self) -> int:
        """Reader sidecar instances that handshook (for the peers gauge)."""
        return len(self._instances)  # called from the metrics server's thread: one len() of a dict


def expected_readers(topologies: TopologyCache, reader: Identity, tp_size: int, reg: Registration) -> set[int]:
    """Reader TP ranks that read from this rank, for every group (who must confirm)."""
    out: set[int] = set()
    for name, g in reg.groups.items():
        theirs = reader.groups.get(name)
        if theirs is None:
            continue
        for r in range(tp_size):
            rank = RankInfo(r, tp_size, reader.rank.pp_rank, reader.rank.pp_size)
            try:
                topo = topologies.topology(f"<{name}", theirs, g.layout, rank, reg.rank.tp_size)
            except KvxferError:
                continue
            if any(s.remote_rank == reg.rank.tp_rank for s in topo.sources()):
                out.add(r)
    return out or {reader.rank.tp_rank}
