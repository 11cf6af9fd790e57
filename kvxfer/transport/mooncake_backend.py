"""Mooncake transfer engine data plane (P2P handshake; TCP here, RDMA where the host has it).

Mooncake addresses peers by a session name (``host:rpc_port``) and remote memory by its virtual
address; the serving engine rejects addresses outside its registered buffers.

Waiting for transfers: the binding's own waits (``batch_transfer_sync`` and
``get_batch_transfer_status``) poll a batch's status in a loop without sleeping, so a thread
waiting in them spins a core for as long as the batch is in flight (on a 2-core host competing with
the engine's own transfer threads), and they give up after ``MC_TRANSFER_TIMEOUT`` while the
transfers go on: a READ from a stalled peer lands when the peer resumes, long after (measured:
bench/fence_probe.py, docs/transports.md). The only status call that returns at once is
``transfer_check_status``, and it looks at the first transfer of a batch only. So each descriptor
is submitted as a batch of its own (``batch_transfer_async``), at most ``MAX_BATCH`` at a time, and
the worker polls them in order with a sleeping back-off until each has ended, so that it knows when
no byte can land any more. The completion notice rides on a one-byte synchronous READ sent after
the last transfer, so it is sent once, and only for a complete transfer.

Each transfer runs on a worker thread of its peer's small pool (a peer that stops answering ties
up only its own workers, and at most ``WORKERS_PER_PEER`` transfers per peer are in flight, as
Mooncake's TCP transport queues a bounded number of transfers per peer). The event loop awaits the
worker with the timeout; after a timeout or a cancellation the worker submits no further
transfers, sends no notice, and waits for those in flight to end (the fence) for at most
``fence_budget_s``; those still in flight then are kept and checked until they end, and the
transfer is reported unfenced (:class:`~kvxfer.transport.errors.TransferUnfencedError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from typing import Any

import numpy as np

from kvxfer.ports import free_port
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
    TransferUnfencedError,
    TransportError,
    UnfencedOp,
    describe_span,
)
from kvxfer.transport.registry import register_transport

__all__ = ["MAX_BATCH", "MooncakeTransport"]

# Batches over 1024 descriptors can fail (-1) in mooncake-transfer-engine-non-cuda 0.3.13 (its TCP
# transport queues at most 1024 transfers per peer); a batch plus its sentinel stays within that.
MAX_BATCH = 1023
WORKERS_PER_PEER = 2


def _new_engine(transfer_timeout_s: int) -> tuple[Any, int]:
    """A TransferEngine whose synchronous waits give up after ``transfer_timeout_s`` unless
    MC_TRANSFER_TIMEOUT is set (the binding reads it once, in its constructor; default 30 s, at
    least 5), and the timeout in effect."""
    from mooncake.engine import TransferEngine

    if "MC_TRANSFER_TIMEOUT" in os.environ:
        try:
            effective = max(5, int(os.environ["MC_TRANSFER_TIMEOUT"]))
        except ValueError:
            effective = 5  # the binding's atoi reads garbage as 0, then takes its minimum
        return TransferEngine(), effective
    os.environ["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
    try:
        return TransferEngine(), max(5, transfer_timeout_s)
    finally:
        os.environ.pop("MC_TRANSFER_TIMEOUT", None)


@register_transport("mooncake")
class MooncakeTransport(Transport):
    """A Mooncake TransferEngine."""

    #: Its P2P handshake port hands the segment descriptor (every registered buffer's address) to any
    #: caller, and its data port serves READ and WRITE into those buffers, with no credential.
    serves_memory_openly = True

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
        self._engine: Any
        self._engine, self._wait_limit_s = _new_engine(cfg.mooncake_transfer_timeout_s)
        rc = self._engine.initialize(
            f"{cfg.listen_host}:{port}", "P2PHANDSHAKE", cfg.mooncake_protocol, cfg.mooncake_device
        )
        if rc != 0:
            raise BackendUnavailableError(
                f"initialize({cfg.listen_host}:{port}, P2PHANDSHAKE, {cfg.mooncake_protocol!r}, "
                f"{cfg.mooncake_device!r}) returned {rc}",
                backend="mooncake",
            )
        self.session = f"{cfg.listen_host}:{self._engine.get_rpc_port()}"
        # Where sentinels land (see the module docstring); registered like any other local memory.
        self._scratch = np.zeros(64, dtype=np.uint8)
        if self._engine.register_memory(self._scratch.ctypes.data, self._scratch.size) != 0:
            raise BackendUnavailableError("register_memory of a 64-byte scratch buffer failed", backend="mooncake")
        # Per transfer reported unfenced, its Mooncake batches still in flight, freed once they ended.
        self._stale: list[tuple[UnfencedOp, list[int]]] = []
        self._stale_lock = threading.Lock()
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
        unfenced = UnfencedOp(op, peer)  # what a failure's error carries, should it come before the end
        work = self._pools[peer].submit(self._run_batches, session, local, remote, self._ops[op], notice, stop,
                                        unfenced)  # fmt: skip
        done = asyncio.wrap_future(work)
        failure: TransportError | None = None
        cancelled = False
        try:
            rc, failed, left = await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            failure = TransferTimeoutError(
                f"{self._describe(op, local, remote)} did not complete within {timeout:.3f}s",
                backend="mooncake",
                peer=peer,
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if done.cancelled() and (task is None or not task.cancelling()):
                # Not our caller's cancel: remove_peer shut the peer's pool down while this transfer
                # waited for a worker, so it never ran. A bare CancelledError would read as the
                # caller's own cancel (a TaskGroup even counts such a task as fine).
                raise TransferFailedError(
                    f"{self._describe(op, local, remote)} did not run: the peer was removed while it waited for a "
                    "worker",
                    backend="mooncake",
                    peer=peer,
                ) from None
            cancelled = True
        if failure is None and not cancelled:
            # The worker returns once every transfer it submitted ended (or, a transfer having failed,
            # once the fence budget ran out on the others: ``left`` of them still in flight).
            try:
                return self._result(op, local, remote, peer, session, start, rc, failed)
            except TransferFailedError as exc:
                if not left:
                    raise
                self._count_unfenced(op, peer)
                raise TransferUnfencedError(
                    f"{exc.what}; {left} of its transfers were still in flight after the fence budget "
                    f"({self.config.fence_budget_s:.3g}s), so their bytes may still land",
                    backend="mooncake",
                    peer=peer,
                    detail=exc.detail,
                    unfenced=unfenced,
                ) from None
        # The fence: Mooncake cannot stop a transfer it submitted (its own wait gives up and the bytes
        # still land), so the error waits until the worker saw each of them end.
        stop.set()
        ended, left, cancel_came = await self._fence(work, done)
        if not ended and left == 0:
            # The worker is still inside the library: the operation ended once it returns with nothing
            # left in flight (what it leaves is watched in _stale).
            work.add_done_callback(lambda w: _ended_if_nothing_left(w, unfenced))
        self._end_failed(op, peer, failure, cancelled=cancelled or cancel_came, ended=ended,
                         in_flight=f"{left or 'some'} of its transfers were", unfenced=unfenced)  # fmt: skip

    async def _fence(
        self, work: concurrent.futures.Future[tuple[int, int, int]], done: asyncio.Future[tuple[int, int, int]]
    ) -> tuple[bool, int, bool]:
        """Wait for the worker (told to stop) to see its transfers end. Returns (they all ended, how many
        it left in flight, a cancel came meanwhile: re-raised by the caller once the wait is over)."""
        if work.cancel():
            return True, 0, False  # still waiting for a worker: nothing was submitted
        # The worker gives up by itself after the budget; a worker stuck inside a library call (one
        # opening a connection to a stopped peer) is waited for a little longer, then not at all.
        deadline = time.monotonic() + self.config.fence_budget_s + 1.0
        cancelled = False
        while not done.done():
            try:
                await asyncio.wait_for(asyncio.shield(done), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                return False, 0, cancelled
            except asyncio.CancelledError:
                if done.cancelled():
                    return True, 0, cancelled  # the pool was shut down before the worker ran
                cancelled = True
            except Exception:
                break
        if done.cancelled() or done.exception() is not None:
            return False, 0, cancelled
        unfenced = done.result()[2]
        return unfenced == 0, unfenced, cancelled

    def _result(
        self, op: Op, local: U64, remote: U64, peer: str, session: str, start: float, rc: int, failed: int
    ) -> TransferResult:
        if rc != 0:
            n_batches = -(-local.shape[0] // MAX_BATCH)
            lo, hi = failed * MAX_BATCH, min(local.shape[0], (failed + 1) * MAX_BATCH)
            where = (
                f"in batch {failed + 1} of {n_batches} (descriptors {lo}-{hi - 1})"
                if failed < n_batches
                else "sending its completion notice"
            )
            raise TransferFailedError(
                f"{self._describe(op, local, remote)} failed after {time.monotonic() - start:.3f}s {where}",
                backend="mooncake",
                peer=peer,
                detail=f"transfer to session {session} returned {rc}; the engine's log (stderr) says why",
            )
        return TransferResult(int(local[:, 1].sum()), int(local.shape[0]), time.monotonic() - start)

    def _run_batches(
        self, session: str, local: U64, remote: U64, opcode: Any, notice: Any, stop: threading.Event,
        unfenced: UnfencedOp,
    ) -> tuple[int, int, int]:  # fmt: skip
        """Run ``MAX_BATCH``-sized batches one after the other until one fails or ``stop`` is set, then
        send the notice. Returns (return code, index of the batch it belongs to; the notice is the
        batch after the last, transfers left in flight when the fence budget ran out)."""
        n = local.shape[0]
        for i, lo in enumerate(range(0, n, MAX_BATCH)):
            if stop.is_set():
                return -1, i, 0
            rc, left = self._one_batch(session, local[lo : lo + MAX_BATCH], remote[lo : lo + MAX_BATCH], opcode,
                                       stop, unfenced)  # fmt: skip
            if rc != 0 or left:
                return rc or -1, i, left
        if notice is not None and not stop.is_set():
            sentinel = ([self._scratch.ctypes.data], [int(remote[-1, 0])], [1])
            rc = int(self._engine.batch_transfer_sync(session, *sentinel, self._ops["READ"], notice))
            if rc != 0:
                return rc, -(-n // MAX_BATCH), 0
        return 0, 0, 0

    def _one_batch(
        self, session: str, local: U64, remote: U64, opcode: Any, stop: threading.Event, unfenced: UnfencedOp
    ) -> tuple[int, int]:
        """Submit each descriptor as a Mooncake batch of its own and wait until every one has ended.

        ``transfer_check_status``, the one status call that returns at once, sees the first transfer
        of a batch only (and ``get_batch_transfer_status`` spins, then gives up while the transfers
        go on), so a transfer per batch is what lets the wait see each end. Once ``stop`` is set or a
        transfer failed, the wait lasts at most the fence budget; transfers still in flight then are
        kept (``_stale``) until they end, when ``unfenced`` is marked ended. Returns (return code,
        transfers left in flight)."""
        engine = self._engine
        self._free_stale()
        ids: list[int] = []
        rc = 0
        for src, dst, size in zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist(), strict=True):
            if stop.is_set():
                rc = -1
                break
            batch = int(engine.batch_transfer_async(session, [src], [dst], [size], opcode))
            if batch == 0:
                rc = -1
                break
            ids.append(batch)
        delay = self.config.poll_min_s
        give_up: float | None = None
        i = 0
        while i < len(ids):
            state = int(engine.transfer_check_status(ids[i]))  # frees the batch once it ended (1 done, -1 failed)
            if state in (1, -1):
                rc = rc or (0 if state == 1 else -1)
                i += 1
                continue
            if give_up is None and (rc != 0 or stop.is_set()):
                give_up = time.monotonic() + self.config.fence_budget_s
            if give_up is not None and time.monotonic() >= give_up:
                with self._stale_lock:
                    self._stale.append((unfenced, ids[i:]))  # not checked yet: still allocated, checked until they end
                return rc or -1, len(ids) - i
            time.sleep(delay)
            delay = min(delay * 2, self.config.poll_max_s)
        return rc, 0

    def _free_stale(self) -> None:
        with self._stale_lock:
            check = self._engine.transfer_check_status  # frees a batch that ended
            kept = [(unfenced, [b for b in group if int(check(b)) not in (1, -1)]) for unfenced, group in self._stale]
            for unfenced, group in kept:
                unfenced.ended = not group
            self._stale = [(unfenced, group) for unfenced, group in kept if group]

    def unfenced_live(self) -> int:
        self._free_stale()
        with self._stale_lock:
            return len(self._stale)

    def poll_notifications(self) -> list[Notification]:
        return [Notification(n.name, n.msg.encode("latin-1")) for n in self._engine.get_notifies()]

    def close(self) -> None:
        for peer in list(self._pools):
            self.remove_peer(peer)
        self._peers.clear()


def _ended_if_nothing_left(work: concurrent.futures.Future[tuple[int, int, int]], unfenced: UnfencedOp) -> None:
    """A worker the fence stopped waiting for returned: its operation ended unless it left transfers in flight."""
    if not work.cancelled() and work.exception() is None and work.result()[2] == 0:
        unfenced.ended = True
