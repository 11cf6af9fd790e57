"""The data plane as the sidecar uses it: register memory, exchange metadata, READ descriptor arrays.

:class:`DataPlane` is the small surface the control plane needs. :func:`create_data_plane` builds
one from :mod:`kvxfer.transport` (the NIXL and Mooncake backends, one registry); while that
package does not provide a backend yet, NIXL falls back to an interim adapter
(:class:`_InterimNixl`) so the sidecar works end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import time
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError
from kvxfer.topology import RegionTable

__all__ = ["DataPlane", "DataPlaneError", "create_data_plane"]

U64 = npt.NDArray[np.uint64]


class DataPlaneError(KvxferError):
    """The data plane failed (registration, metadata, or a transfer)."""

    status = "UNAVAILABLE"


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
        """READ ``remote`` (N, 3) descriptors of ``peer`` into ``local`` ones; cancellable."""

    def close(self) -> None:
        """Release the agent."""


def create_data_plane(backend: str, name: str, *, options: dict[str, Any] | None = None) -> DataPlane:
    """A data plane for ``backend`` (``nixl`` or ``mooncake``) named ``name``.

    ``options``: ``nixl_backends``, ``data_port``, ``mooncake_protocol``, ``mooncake_device``,
    ``listen_host`` (the address peers reach this host at).
    """
    options = options or {}
    try:
        transport_pkg = importlib.import_module("kvxfer.transport")
    except ImportError:
        transport_pkg = None
    if transport_pkg is not None:
        config = transport_pkg.TransportConfig(
            nixl_backends=tuple(options.get("nixl_backends", ("UCX",))),
            listen_host=str(options.get("listen_host", "127.0.0.1")),
            data_port=int(options.get("data_port", 0)),
            protocol=str(options.get("mooncake_protocol", "tcp")),
            device_names=str(options.get("mooncake_device", "")),
        )
        try:
            return _TransportAdapter(transport_pkg.create_transport(backend, name, config))
        except KvxferError as exc:
            if backend != "nixl":
                raise DataPlaneError(f"backend: {exc.message}", field="backend") from None
    if backend == "nixl":
        return _InterimNixl(name, backends=tuple(options.get("nixl_backends", ("UCX",))))
    raise DataPlaneError(f"backend: {backend!r} is not available in this build (kvxfer.transport)", field="backend")


class _TransportAdapter:
    """A :mod:`kvxfer.transport` Transport seen through :class:`DataPlane`."""

    def __init__(self, transport: Any) -> None:
        self._t = transport
        self.backend = str(transport.backend)
        self.agent_name = str(transport.agent_name)

    def register(self, table: RegionTable, mem_type: str) -> Any:
        return self._t.register(table, mem_type)

    def deregister(self, handle: Any) -> None:
        self._t.deregister(handle)

    def metadata(self) -> bytes:
        return bytes(self._t.metadata())

    def add_peer(self, metadata: bytes) -> str:
        return str(self._t.add_peer(metadata))

    def remove_peer(self, name: str) -> None:
        self._t.remove_peer(name)

    async def read(
        self, peer: str, local: U64, remote: U64, *, mem_type: str, remote_mem_type: str, budget: float
    ) -> None:
        await self._t.read(peer, local, remote, timeout=budget, mem_type=mem_type, remote_mem_type=remote_mem_type)

    def close(self) -> None:
        self._t.close()


def _progress_delay_us() -> int:
    import os

    try:
        return max(0, int(os.environ.get("KVXFER_NIXL_PROGRESS_DELAY_US", "100")))
    except ValueError:
        return 100


def _agent_with_progress_delay(name: str, config: Any, factory: Any, delay_us: int) -> Any:
    """A NIXL agent whose progress thread sleeps ``delay_us`` between rounds.

    nixl_agent hard-codes a zero delay, so its progress thread spins a whole core per agent even
    when idle (measured: 95% CPU per idle sidecar, which on a 2-core host halves everyone's speed).
    The binding's config has the knob; the wrapper class below keeps nixl_agent from zeroing it.
    """
    try:
        api = sys.modules[factory.__module__]
        base = api.nixlBind.nixlAgentConfig
    except (AttributeError, KeyError):
        return factory(name, config)

    class _Config(base):  # type: ignore[misc,valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    api.nixlBind.nixlAgentConfig = _Config
    try:
        return factory(name, config)
    finally:
        api.nixlBind.nixlAgentConfig = base


class _InterimNixl:
    """NIXL agent with just what the sidecar needs (stands in until kvxfer.transport lands)."""

    backend = "nixl"

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise DataPlaneError(f"backend: NIXL is not installed ({exc})", field="backend") from None
        self.agent_name = name
        self._agent = _agent_with_progress_delay(
            name, nixl_agent_config(backends=list(backends)), nixl_agent, _progress_delay_us()
        )

    def register(self, table: RegionTable, mem_type: str) -> Any:
        descs = np.stack([table.base, table.size, table.device], axis=1).astype(np.uint64)
        try:
            return self._agent.register_memory(descs, mem_type)
        except Exception as exc:
            raise DataPlaneError(f"NIXL register_memory failed: {exc}", field="memory") from None

    def deregister(self, handle: Any) -> None:
        self._agent.deregister_memory(handle)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise DataPlaneError(f"NIXL could not load the peer's metadata: {exc}", field="data_plane") from None
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        with contextlib.suppress(Exception):  # forgetting an unknown peer is not an error
            self._agent.remove_remote_agent(name)

    async def read(
        self, peer: str, local: U64, remote: U64, *, mem_type: str, remote_mem_type: str, budget: float
    ) -> None:
        agent = self._agent
        try:
            ld = agent.get_xfer_descs(np.ascontiguousarray(local), mem_type)
            rd = agent.get_xfer_descs(np.ascontiguousarray(remote), remote_mem_type)
            handle = agent.initialize_xfer("READ", ld, rd, peer)
        except Exception as exc:
            raise DataPlaneError(f"NIXL could not prepare a READ from {peer}: {exc}", field="data_plane") from None
        try:
            start = time.monotonic()
            try:
                state = agent.transfer(handle)
                delay = 20e-6
                while state == "PROC":
                    # Sleep-poll with a growing interval: small transfers finish in microseconds,
                    # large ones should not spin a core.
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.002)
                    state = agent.check_xfer_state(handle)
            except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError for a dead peer
                raise DataPlaneError(
                    f"NIXL READ from {peer} failed after {time.monotonic() - start:.3f}s: {type(exc).__name__}: {exc}",
                    field="data_plane",
                ) from None
            if state != "DONE":
                raise DataPlaneError(
                    f"NIXL READ from {peer} failed after {time.monotonic() - start:.3f}s (state {state})",
                    field="data_plane",
                )
        finally:
            with contextlib.suppress(Exception):  # a handle NIXL cannot cancel goes with the agent
                agent.release_xfer_handle(handle)

    def close(self) -> None:
        self._agent = None
