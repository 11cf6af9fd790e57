"""One registry of data-plane backends, picked by name.

Built-in backends are imported on first use, so a host without Mooncake can still run NIXL and
the other way round. Third-party backends register with :func:`register_transport`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvxfer.transport.base import Transport, TransportConfig
from kvxfer.transport.cuda_ipc_direct import CudaIpcDirect
from kvxfer.transport.errors import BackendUnavailableError

__all__ = ["available_transports", "create_transport", "register_transport", "transport_class"]

_BUILTIN = {
    "nixl": "kvxfer.transport.nixl_backend",
    "mooncake": "kvxfer.transport.mooncake_backend",
    "worker": "kvxfer.transport.worker_agent",
}
_REGISTRY: dict[str, type[Transport]] = {}


def register_transport(name: str) -> Callable[[type[Transport]], type[Transport]]:
    """Class decorator: make ``cls`` available as backend ``name``."""

    def deco(cls: type[Transport]) -> type[Transport]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_transports() -> list[str]:
    """Names that :func:`create_transport` accepts."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def transport_class(name: str) -> type[Transport]:
    """The class registered as ``name`` (importing a built-in backend on first use)."""
    if name not in _REGISTRY and name in _BUILTIN:
        try:
            importlib.import_module(_BUILTIN[name])
        except ImportError as exc:
            raise BackendUnavailableError(f"cannot import the {name} backend", backend=name, detail=str(exc)) from None
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; available: {', '.join(available_transports())}", backend=name
        ) from None


def create_transport(name: str, agent_name: str, config: TransportConfig | None = None) -> Transport:
    """A new agent of backend ``name``; wrapped in the same-host CUDA IPC shortcut when
    ``config.cuda_ipc_direct`` is set (:mod:`kvxfer.transport.cuda_ipc_direct`)."""
    transport = transport_class(name)(agent_name, config)
    if transport.config.cuda_ipc_direct and transport.same_host_shortcut:
        return CudaIpcDirect(transport)
    return transport
