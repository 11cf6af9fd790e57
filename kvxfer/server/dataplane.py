"""The data plane as the sidecar uses it: register memory, exchange metadata, READ descriptor arrays.

:class:`DataPlane` is the small surface the control plane needs; :func:`create_data_plane` builds
one from :mod:`kvxfer.transport` (NIXL or Mooncake, one registry). Keeping this seam lets tests put
a fault injector between the sidecar and a real backend (see tests/sidecar/helpers.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError
from kvxfer.topology import RegionTable
from kvxfer.transport import Transport, TransportConfig, create_transport

__all__ = ["DataPlane", "DataPlaneError", "create_data_plane"]

U64 = npt.NDArray[np.uint64]


class DataPlaneError(KvxferError):
    """The data plane could not be started."""

    status = "FAILED_PRECONDITION"


class DataPlane(Protocol):
    """What the sidecar needs from a transfer backend."""

    backend: str
    agent_name: str

    def register(self, table: RegionTable, mem_type: str) -> Any:
        """Register every region of ``table``; returns a handle for :meth:`deregister`."""

    def deregister(self, handle: Any) -> None:
        """Undo :meth:`register`."""

    def metadata(self) -> bytes:
        """What a peer loads to reach this agent (after registration)."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the name to pass to :meth:`read`."""

    def remove_peer(self, name: str) -> None:
        """Forget a peer."""

    async def read(
        self, peer: str, local: U64, remote: U64, *, mem_type: str, remote_mem_type: str, budget: float
    ) -> None:
        """READ ``remote`` (N, 3) descriptors of ``peer`` into ``local`` ones within ``budget`` seconds."""

    def close(self) -> None:
        """Release the agent."""


def create_data_plane(backend: str, name: str, *, options: dict[str, Any] | None = None) -> DataPlane:
    """A data plane for ``backend`` (``nixl`` or ``mooncake``) named ``name``.

    ``options``: ``nixl_backends``, ``data_port``, ``mooncake_protocol``, ``mooncake_device``,
    ``listen_host`` (the address peers reach this host at).
    """
    options = options or {}
    config = TransportConfig(
        nixl_backends=tuple(options.get("nixl_backends", ("UCX",))),
        listen_host=str(options.get("listen_host", "127.0.0.1")),
        data_port=int(options.get("data_port", 0)),
        protocol=str(options.get("mooncake_protocol", "tcp")),
        device_names=str(options.get("mooncake_device", "")),
    )
    try:
        return _TransportAdapter(create_transport(backend, name, config))
    except KvxferError as exc:
        raise DataPlaneError(
            f"backend: the {backend} data plane did not start: {exc.message}", field="backend"
        ) from None


class _TransportAdapter:
    """A :class:`kvxfer.transport.Transport` seen through :class:`DataPlane`."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self.backend = transport.backend
        self.agent_name = transport.agent_name

    def register(self, table: RegionTable, mem_type: str) -> Any:
        return self._t.register(table, "VRAM" if mem_type == "VRAM" else "DRAM")

    def deregister(self, handle: Any) -> None:
        self._t.deregister(handle)

    def metadata(self) -> bytes:
        return self._t.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self._t.add_peer(metadata)

    def remove_peer(self, name: str) -> None:
        self._t.remove_peer(name)

    async def read(
        self, peer: str, local: U64, remote: U64, *, mem_type: str, remote_mem_type: str, budget: float
    ) -> None:
        await self._t.read(
            peer, local, remote, timeout=budget, mem_type="VRAM" if mem_type == "VRAM" else "DRAM",
            remote_mem_type="VRAM" if remote_mem_type == "VRAM" else "DRAM",
        )  # fmt: skip

    def close(self) -> None:
        self._t.close()
