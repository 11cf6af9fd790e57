"""Data planes behind one interface: NIXL (default), the Mooncake transfer engine, and a worker's own agent."""

from kvxfer.transport.base import (
    MemType,
    Notification,
    Op,
    Registration,
    SameHostGather,
    TransferResult,
    Transport,
    TransportConfig,
    WorkerAgentInfo,
    mem_type,
)
from kvxfer.transport.errors import (
    BackendUnavailableError,
    PeerUnknownError,
    RegistrationError,
    TransferFailedError,
    TransferTimeoutError,
    TransferUnfencedError,
    TransportError,
)
from kvxfer.transport.registry import available_transports, create_transport, register_transport, transport_class

__all__ = [
    "BackendUnavailableError",
    "MemType",
    "Notification",
    "Op",
    "PeerUnknownError",
    "Registration",
    "RegistrationError",
    "SameHostGather",
    "TransferFailedError",
    "TransferResult",
    "TransferTimeoutError",
    "TransferUnfencedError",
    "Transport",
    "TransportConfig",
    "TransportError",
    "WorkerAgentInfo",
    "available_transports",
    "create_transport",
    "mem_type",
    "register_transport",
    "transport_class",
]
