"""Mooncake transfer engine data plane (P2P handshake; TCP here, RDMA where the host has it).

Mooncake addresses peers by a session name (``host:rpc_port``) and remote memory by its virtual
address; the serving engine rejects addresses outside its registered buffers. Its batch call that
carries a completion notice is synchronous, so transfers run on worker threads and the event loop
awaits them with a timeout (the loop itself never polls). Every peer has its own small pool of
workers, so a peer that stops answering ties up only its own. A transfer that outlives its timeout
or is cancelled submits no further batches (and so sends no notice); the batch in flight finishes
or fails on its worker thread, touching only registered memory.

Mooncake's Python binding (0.3.x) can only wait for a batch by polling its status in a loop without
sleeping (``batch_transfer_sync`` and ``get_batch_transfer_status`` alike), so each worker thread
spins while its batch is in flight; that wait ends at ``mooncake_transfer_timeout_s`` plus one
second per GiB when a peer goes silent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import threading
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
WORKERS_PER_PEER = 2


def _new_engine(transfer_timeout_s: int) -> Any:
    """A TransferEngine whose synchronous waits give up after ``transfer_timeout_s`` (unless MC_TRANSFER_TIMEOUT
    is set): the binding reads that variable once, in its constructor, and defaults to 30 s."""
    from mooncake.engine import TransferEngine

    if "MC_TRANSFER_TIMEOUT" in os.environ:
        return TransferEngine()
    os.environ["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
    try:
        return TransferEngine()
    finally:
        os.environ.pop("MC_TRANSFER_TIMEOUT", None)


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
            from mooncake.engine import TransferNotify, TransferOpcode
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
        self._engine: Any = _new_engine(cfg.mooncake_transfer_timeout_s)
        rc = self._engine.initialize(f"{cfg.listen_host}:{port}", "P2PHANDSHAKE", cfg.protocol, cfg.device_names)
        if rc != 0:
            raise BackendUnavailableError(
                f"initialize({cfg.listen_host}:{port}, P2PHANDSHAKE, {cfg.protocol!r}, {cfg.device_names!r}) "
                f"returned {rc}",
                backend="mooncake",
            )
        self.session = f"{cfg.listen_host}:{self._engine.get_rpc_port()}"
        self._peers: dict[str, str] = {}  # peer name -> session
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # peer name -> its workers

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
        self._track(table)
        return Registration(table, mem_type, addrs)

    def deregister(self, registration: Registration) -> None:
        rc = self._engine.batch_unregister_memory(list(registration.handle))
        if rc != 0:
            raise RegistrationError(f"batch_unregister_memory returned {rc}", backend="mooncake")
        self._untrack(registration.table)

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
        if self._peers.get(name) != session:
            self.remove_peer(name)  # a restarted peer replaces its session, and workers stuck on the old one
        self._peers[name] = session
        if name not in self._pools:
            self._pools[name] = concurrent.futures.ThreadPoolExecutor(
                max_workers=WORKERS_PER_PEER, thread_name_prefix=f"mooncake-{self.agent_name}-{name}"
            )
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)
        pool = self._pools.pop(peer, None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)  # a worker stuck on a dead peer must not block us

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
        stop = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(
            self._pools[peer], self._run_batches, session, local, remote, self._ops[op], notice, stop
        )
        try:
            rc, failed = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TransferTimeoutError(
                f"{self._describe(op, local, remote)} did not complete within {timeout:.3f}s; no further batches "
                "are submitted",
                backend="mooncake",
                peer=peer,
            ) from None
        finally:
            stop.set()
        if rc != 0:
            n_batches = -(-local.shape[0] // MAX_BATCH)
            lo, hi = failed * MAX_BATCH, min(local.shape[0], (failed + 1) * MAX_BATCH)
            raise TransferFailedError(
                f"{self._describe(op, local, remote)} failed after {time.monotonic() - start:.3f}s in batch "
                f"{failed + 1} of {n_batches} (descriptors {lo}-{hi - 1})",
                backend="mooncake",
                peer=peer,
                detail=f"batch_transfer_sync({session!r}) returned {rc}; the engine's log (stderr) says why",
            )
        return TransferResult(int(local[:, 1].sum()), int(local.shape[0]), time.monotonic() - start)

    def _run_batches(
        self, session: str, local: U64, remote: U64, opcode: Any, notice: Any, stop: threading.Event
    ) -> tuple[int, int]:
        """Submit ``MAX_BATCH``-sized batches in order until one fails or ``stop`` is set; the notice
        rides on the last one. Returns (return code, index of the batch it belongs to)."""
        n = local.shape[0]
        for i, lo in enumerate(range(0, n, MAX_BATCH)):
            if stop.is_set():
                return -1, i
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
                return rc, i
        return 0, 0

    def poll_notifications(self) -> list[Notification]:
        return [Notification(n.name, n.msg.encode("latin-1")) for n in self._engine.get_notifies()]

    def close(self) -> None:
        for peer in list(self._pools):
            self.remove_peer(peer)
        self._peers.clear()
