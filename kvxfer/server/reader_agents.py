"""The data-plane agents of the readers a writer pushes into (prefill side, push mode).

A WRITE names its reader by the name the data plane gave the reader's metadata when it was loaded
(:meth:`~kvxfer.transport.Transport.add_peer`). :class:`ReaderAgents` loads each reader rank once
per instance and epoch (a reader that registered again, or restarted, is loaded again) and unloads
the agents nobody will write into: a restarted reader's old instance at the same rank, and the
readers the publisher forgot (decode pods replaced under new engine ids) that hold no offer, so that
the data plane does not keep every reader ever written into.
"""

from __future__ import annotations

from collections.abc import Container, Iterator

from kvxfer.server.identity import Identity
from kvxfer.server.state import Offer, ReaderKey
from kvxfer.transport import Transport

__all__ = ["ReaderAgents"]


class ReaderAgents:
    """The reader ranks loaded on this data plane, each with its name there (see the module docs)."""

    def __init__(self, data_plane: Transport) -> None:
        self.dp = data_plane
        #: The data-plane name of each reader written into, with the instance and epoch it was loaded for.
        self._loaded: dict[ReaderKey, tuple[str, int, str]] = {}

    def __iter__(self) -> Iterator[ReaderKey]:
        """The reader ranks loaded, the first loaded first."""
        return iter(self._loaded)

    def name(self, reader: Identity, known: Container[ReaderKey], offers: dict[str, dict[ReaderKey, Offer]]) -> str:
        """The reader's agent on this data plane, loaded once per reader instance and epoch.

        ``known`` are the reader ranks the publisher still knows, ``offers`` the offers held (request
        id -> reader rank -> offer): a loaded reader in neither is unloaded.
        """
        key: ReaderKey = (reader.engine_id, reader.instance_id, reader.rank.tp_rank, reader.rank.pp_rank)
        for old in [k for k in self._loaded if k[0] == key[0] and k[2:] == key[2:] and k != key]:
            self.unload(old)  # a restarted reader: its old agent is gone
        # Readers the publisher forgot (decode pods replaced under new engine ids) with no offer left:
        # without this, every reader ever written into would stay loaded on the data plane.
        offered = {k for per_reader in offers.values() for k in per_reader}
        for old in [k for k in self._loaded if k != key and k not in known and k not in offered]:
            self.unload(old)
        loaded = self._loaded.get(key)
        if loaded is not None and loaded[1:] == (reader.epoch, reader.instance_id):
            return loaded[0]
        if loaded is not None:
            self.unload(key)
        name = self.dp.add_peer(reader.metadata)
        self._loaded[key] = (name, reader.epoch, reader.instance_id)
        return name

    def unload(self, key: ReaderKey) -> None:
        """Forget the reader rank ``key``'s agent on the data plane (nothing if it is not loaded)."""
        loaded = self._loaded.pop(key, None)
        if loaded is not None:
            self.dp.remove_peer(loaded[0])
