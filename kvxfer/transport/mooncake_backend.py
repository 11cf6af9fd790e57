"""Mooncake transfer engine data plane (P2P handshake; TCP here, RDMA where the host has it).

Mooncake addresses peers by a session name (``host:rpc_port``) and remote memory by its virtual
address; the serving engine rejects addresses outside its registered buffers. Its batch call that
carries a completion notice is synchronous, so transfers run on a small thread pool and the event
loop awaits them with a timeout. A transfer that outlives its timeout is reported as failed; the
engine finishes or fails it on its own thread, touching only registered memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import time
from typing import Any

import numpy as np

from kvxfer.topology import RegionTable
from kvxfer.transport.base import (
    U64,
    MemType,
    Notification,
    Op,
    Registration,
    TransferResult,
    Transport,
    TransportConfig,
    check_descriptors,
)
from kvxfer.transport.errors import (
    BackendUnavailableError,
    PeerUnknownError,
    RegistrationError,
    TransferFailedError,
    TransferTimeoutError,
    describe_span,
)
from kvxfer.transport.registry import register_transport

__all__ = ["MAX_BATCH", "MooncakeTransport"]

# batch_transfer_sync returns -1 for batches over 1024 descriptors (measured with
# mooncake-transfer-engine-non-cuda 0.3.13); larger transfers are split.
MAX_BATCH = 1024


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@register_transport("mooncake")
class MooncakeTransport(Transport):
    """A Mooncake TransferEngine."""

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as exc:
            raise BackendUnavailableError(
                "the Mooncake transfer engine is not installed (mooncake-transfer-engine[-non-cuda]; it needs "
                "libibverbs1, librdmacm1 and libnuma1)",
                backend="mooncake",
                detail=str(exc),
            ) from None
        self._notify_cls = TransferNotify
        self._ops = {"READ": TransferOpcode.Read, "WRITE": TransferOpcode.Write}
        cfg = self.config
        port = cfg.data_port or free_port(cfg.listen_host)
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(f"{cfg.listen_host}:{port}", "P2PHANDSHAKE", cfg.protocol, cfg.device_names)
        if rc != 0:
            raise BackendUnavailableError(
                f"initialize({cfg.listen_host}:{port}, P2PHANDSHAKE, {cfg.protocol!r}, {cfg.device_names!r}) "
                f"returned {rc}",
                backend="mooncake",
            )
        self.session = f"{cfg.listen_host}:{self._engine.get_rpc_port()}"
        self._peers: dict[str, str] = {}  # peer name -> session
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"mooncake-{agent_name}")

    # ------------------------------------------------------------------ memory
    def register(self, table: RegionTable, mem_type: MemType = "DRAM") -> Registration:
        location = "*" if mem_type == "DRAM" else f"cuda:{int(table.device[0]) if table.device.size else 0}"
        addrs, sizes = table.base.tolist(), table.size.tolist()
        rc = self._engine.batch_register_memory(addrs, sizes, location)
        if rc != 0:
            descs = np.stack([table.base, table.size, table.device], axis=1)
            raise RegistrationError(
                f"batch_register_memory of {describe_span(descs)} ({location}) returned {rc}", backend="mooncake"
            )
        return Registration(table, mem_type, addrs)

    def deregister(self, registration: Registration) -> None:
        rc = self._engine.batch_unregister_memory(list(registration.handle))
        if rc != 0:
            raise RegistrationError(f"batch_unregister_memory returned {rc}", backend="mooncake")

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        return json.dumps({"agent": self.agent_name, "session": self.session}).encode()

    def add_peer(self, metadata: bytes) -> str:
        try:
            info = json.loads(metadata)
            name, session = str(info["agent"]), str(info["session"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferFailedError(
                "peer metadata is not Mooncake metadata", backend="mooncake", detail=str(exc)
            ) from None
        self._peers[name] = session  # a restarted peer simply replaces its session
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    # ------------------------------------------------------------------ transfers
    async def transfer(
        self,
        op: Op,
        local: U64,
        remote: U64,
        peer: str,
        *,
        timeout: float,
        notify: bytes | None = None,
        mem_type: MemType = "DRAM",
        remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:
        session = self._peers.get(peer)
        if session is None:
            raise PeerUnknownError("peer was never added (or was removed)", backend="mooncake", peer=peer)
        local, remote = check_descriptors(local, remote)
        notice = self._notify_cls(self.agent_name, notify.decode("latin-1")) if notify else None
        start = time.monotonic()
        fut = asyncio.get_running_loop().run_in_executor(
            self._pool, self._run_batches, session, local, remote, self._ops[op], notice
        )
        try:
            rc = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TransferTimeoutError(
                f"{op} of {describe_span(local)} did not complete within {timeout:.3f}s", backend="mooncake", peer=peer
            ) from None
        if rc != 0:
            raise TransferFailedError(
                f"{op} of local {describe_span(local)} / remote {describe_span(remote)} returned {rc} after "
                f"{time.monotonic() - start:.3f}s",
                backend="mooncake",
                peer=peer,
                detail="see the engine's log for the reason (connection refused, address outside registered buffers)",
            )
        return TransferResult(int(local[:, 1].sum()), int(local.shape[0]), time.monotonic() - start)

    def _run_batches(self, session: str, local: U64, remote: U64, opcode: Any, notice: Any) -> int:
        """Submit ``MAX_BATCH``-sized batches in order; the notice rides on the last one."""
        n = local.shape[0]
        for lo in range(0, n, MAX_BATCH):
            hi = min(n, lo + MAX_BATCH)
            rc = int(
                self._engine.batch_transfer_sync(
                    session,
                    local[lo:hi, 0].tolist(),
                    remote[lo:hi, 0].tolist(),
                    local[lo:hi, 1].tolist(),
                    opcode,
                    notice if hi == n else None,
                )
            )
            if rc != 0:
                return rc
        return 0

    def poll_notifications(self) -> list[Notification]:
        return [Notification(n.name, n.msg.encode("latin-1")) for n in self._engine.get_notifies()]

    def close(self) -> None:
        self._peers.clear()
        with contextlib.suppress(Exception):
            self._pool.shutdown(wait=False, cancel_futures=True)
