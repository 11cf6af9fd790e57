"""Data planes behind one interface: NIXL (default), the Mooncake transfer engine, and a worker's own agent."""

from kvxfer.transport.base import (
    UNFENCED_CANCEL,
    MemType,
    Notification,
    Op,
    Registration,
    SameHostGather,
    TransferResult,
    Transport,
    TransportConfig,
    WorkerAgentInfo,
    cancelled_unfenced,
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
    "UNFENCED_CANCEL",
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
    "cancelled_unfenced",
    "create_transport",
    "mem_type",
    "register_transport",
    "transport_class",
]
