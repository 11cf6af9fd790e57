"""Test harness: real sidecars (in this process or as processes) and in-process synthetic workers."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.client import AsyncClient, KvxferRpcError, PullResult
from kvxfer.config import load_settings
from kvxfer.harness.worker_sim import fill_blocks, poison_blocks, verify_blocks
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import LibraryRef, SharedKVBuffer
from kvxfer.server.app import Sidecar
from kvxfer.topology import RankInfo
from kvxfer.transport import (
    UNFENCED_CANCEL,
    MemType,
    Notification,
    Op,
    Registration,
    TransferFailedError,
    TransferResult,
    TransferTimeoutError,
    TransferUnfencedError,
    Transport,
    TransportConfig,
    UnfencedOp,
    create_transport,
)
from kvxfer.wire import local_pb2
from kvxfer.worker_agent import WorkerAgent

Blocks = Mapping[str, Sequence[int] | npt.NDArray[np.integer]]


class Worker:
    """An in-process synthetic worker: one shared-memory buffer per cache group and a client."""

    def __init__(
        self, sidecar: Sidecar | str, layouts: Mapping[str, KVCacheLayout], rank: RankInfo, *,
        token: str | None = None, library: bool = False, agent: bool = False,
    ) -> None:  # fmt: skip
        self.sidecar = sidecar
        self.layouts = dict(layouts)
        self.rank = rank
        self.library = library
        #: With ``agent``: this worker's own NIXL agent, driven by a ``--backend worker`` sidecar.
        self.agent = WorkerAgent() if agent else None
        self._serving: asyncio.Future[None] | None = None
        self._agent_refs: dict[str, LibraryRef] = {}
        self.buffers = {g: SharedKVBuffer.create(lay) for g, lay in layouts.items()}
        target = sidecar if isinstance(sidecar, str) else sidecar.local_target
        self.client = AsyncClient(target, token=token, timeout=30.0)

    async def register(self) -> dict[str, Any]:
        """Register every group (shared memory, or raw addresses in library mode)."""
        if self.agent is not None:
            if self._serving is None:
                self._agent_refs = {g: self.agent.register(self.layouts[g], b.regions) for g, b in self.buffers.items()}
                self._serving = asyncio.ensure_future(self.agent.serve(self.client))
            groups = {g: (self.layouts[g], self._agent_refs[g]) for g in self.buffers}
            return await self.client.register_caches(groups, rank=self.rank, worker_id=f"w{self.rank.tp_rank}",
                                                     worker_agent=self.agent.info())  # fmt: skip
        if self.library:
            groups = {g: (self.layouts[g], LibraryRef.from_arrays(b.regions)) for g, b in self.buffers.items()}
        else:
            groups = {g: (self.layouts[g], b.ref()) for g, b in self.buffers.items()}
        return await self.client.register_caches(groups, rank=self.rank, worker_id=f"w{self.rank.tp_rank}")

    async def prefill(self, rid: str, blocks: Blocks, salt: int, lease: float = 0.0) -> int:
        """Write the request's contents and publish it."""
        self.fill(blocks, salt)
        return await self.client.publish(rid, blocks, lease_seconds=lease)

    def fill(self, blocks: Blocks, salt: int) -> None:
        """Write a request's contents (what :meth:`verify` checks on the other side)."""
        for g, ids in blocks.items():
            fill_blocks(self.buffers[g], self.rank, ids, salt)

    async def pull(self, rid: str, remotes: Sequence[Sidecar | str], blocks: Blocks, **kw: Any) -> PullResult:
        """Poison the destination blocks and pull."""
        self.poison(blocks)
        addresses = [r if isinstance(r, str) else r.peer_address for r in remotes]
        return await self.client.pull(rid, addresses, blocks, **kw)

    def poison(self, blocks: Blocks) -> None:
        """Overwrite destination blocks."""
        for g, ids in blocks.items():
            poison_blocks(self.buffers[g], ids)

    def verify(self, blocks: Blocks, salt: int) -> tuple[int, int]:
        """(bytes checked, bytes wrong) over every group."""
        checked = bad = 0
        for g, ids in blocks.items():
            c, b = verify_blocks(self.buffers[g], self.rank, ids, salt)
            checked, bad = checked + c, bad + b
        return checked, bad

    async def close(self) -> None:
        if self.agent is not None:
            await self.agent.aclose()
            if self._serving is not None:
                self._serving.cancel()
                await asyncio.gather(self._serving, return_exceptions=True)
        await self.client.close()
        for b in self.buffers.values():
            b.close()


class Harness:
    """Creates sidecars and workers for one test and tears them all down."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        # Unix socket paths are limited to 108 bytes: keep them short.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kx-"))
        self.sidecars: list[Sidecar] = []
        self.workers: list[Worker] = []
        self._n = 0

    async def sidecar(
        self, name: str | None = None, *, role: str = "both", engine_id: str | None = None,
        data_plane: Transport | None = None, **settings: Any,
    ) -> Sidecar:  # fmt: skip
        """Start an in-process sidecar on loopback (ephemeral ports)."""
        self._n += 1
        name = name or f"s{self._n}"
        flags: dict[str, Any] = {
            "engine_id": engine_id or name, "role": role, "peer_listen": "127.0.0.1:0",
            "local_socket": str(self.sock_dir / f"{name}.sock"), "metrics_listen": "", "log_level": "warning",
            "drain_seconds": 5, **settings,
        }  # fmt: skip
        sc = Sidecar(load_settings(flags, env={}), data_plane=data_plane)
        await sc.start()
        self.sidecars.append(sc)
        return sc

    async def worker(
        self, sidecar: Sidecar, layouts: Mapping[str, KVCacheLayout], rank: tuple[int, int] = (0, 1), *,
        register: bool = True, **kw: Any,
    ) -> Worker:  # fmt: skip
        """An in-process worker bound to ``sidecar`` (registered unless told otherwise)."""
        w = Worker(sidecar, layouts, RankInfo(*rank), **kw)
        self.workers.append(w)
        if register:
            await w.register()
        return w

    async def deployment(
        self, prefill: Mapping[str, KVCacheLayout] | Sequence[Mapping[str, KVCacheLayout]],
        decode: Mapping[str, KVCacheLayout] | Sequence[Mapping[str, KVCacheLayout]],
        *, prefill_tp: int = 1, decode_tp: int = 1, agent: bool = False, **sidecar_settings: Any,
    ) -> tuple[list[Sidecar], list[Worker], list[Sidecar], list[Worker]]:  # fmt: skip
        """One sidecar + worker per rank on each side (``prefill`` engine and ``decode`` engine)."""

        def per_rank(spec: Any, n: int) -> list[Mapping[str, KVCacheLayout]]:
            return list(spec) if isinstance(spec, Sequence) else [spec] * n

        ps, pw, ds, dw = [], [], [], []
        token_file = sidecar_settings.get("token_file")
        token = Path(token_file).read_text().strip() if token_file else None  # noqa: ASYNC240 - the workers hold it too
        for q, lay in enumerate(per_rank(prefill, prefill_tp)):
            sc = await self.sidecar(f"p{q}-{self._n}", role="prefill", engine_id="prefill", **sidecar_settings)
            ps.append(sc)
            pw.append(await self.worker(sc, lay, (q, prefill_tp), token=token, agent=agent))
        for r, lay in enumerate(per_rank(decode, decode_tp)):
            sc = await self.sidecar(f"d{r}-{self._n}", role="decode", engine_id="decode", **sidecar_settings)
            ds.append(sc)
            dw.append(await self.worker(sc, lay, (r, decode_tp), token=token, agent=agent))
        return ps, pw, ds, dw

    async def close(self) -> None:
        for w in self.workers:
            await w.close()
        await asyncio.gather(*(s.stop(0) for s in self.sidecars), return_exceptions=True)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


async def transfer(
    pw: Sequence[Worker], ps: Sequence[Sidecar], dw: Sequence[Worker], rid: str, p_blocks: Blocks, d_blocks: Blocks,
    salt: int, **pull_kw: Any,
) -> list[PullResult]:  # fmt: skip
    """Publish on every prefill rank, pull on every decode rank, verify every byte; returns the pulls."""
    for w in pw:
        await w.prefill(rid, p_blocks, salt)
    results = await asyncio.gather(*(w.pull(rid, ps, d_blocks, **pull_kw) for w in dw))
    for w in dw:
        checked, bad = w.verify(d_blocks, salt)
        assert bad == 0, f"{bad} of {checked} bytes differ on decode rank {w.rank.tp_rank}"
        assert checked == sum(
            np.asarray(ids).size * w.layouts[g].page_bytes * w.layouts[g].num_layers for g, ids in d_blocks.items()
        )
    return list(results)


async def expect_error(code: grpc.StatusCode, coro: Any, *fragments: str) -> KvxferRpcError:
    """Await ``coro``; assert it fails with ``code`` and a message containing every fragment."""
    with pytest.raises(KvxferRpcError) as info:
        await coro
    exc = info.value
    assert exc.code == code, f"expected {code.name}, got {exc.code.name}: {exc.details}"
    for f in fragments:
        assert f in exc.details, f"{f!r} not in message {exc.details!r}"
    return exc


def attention(
    layers: int = 4, blocks: int = 64, block_size: int = 16, heads: int = 8, tp: int = 1, **kw: Any
) -> KVCacheLayout:
    """A small attention layout of a ``heads``-head model split over ``tp`` ranks."""
    return KVCacheLayout.attention(
        num_layers=layers, num_blocks=blocks, block_size=block_size, num_kv_heads=heads // tp, total_kv_heads=heads,
        head_size=kw.pop("head_size", 64), **kw,
    )  # fmt: skip


class DelayedDataPlane(Transport):
    """FAULT INJECTOR (not a mock): the real NIXL data plane, with a hold before each READ is posted.

    Loopback moves a test-sized request in well under a millisecond, so "abort / kill / drain while a
    transfer is in flight" cannot be produced reliably by size alone; this holds each READ for
    ``delay`` seconds (like a slow network) and then performs it for real. ``reading`` is set when
    a READ reached the data plane, so a test can act exactly then.
    """

    name = "nixl"

    def __init__(
        self, name: str, delay: float, *, drain: bool = False, times_out: bool = False, unfenced: bool = False,
        fence_seconds: float = 0.0, fail_first: float | None = None, unfenced_first: bool = False,
    ) -> None:  # fmt: skip
        self.inner = create_transport("nixl", name, TransportConfig(cuda_ipc_direct=True))
        super().__init__(self.inner.agent_name, self.inner.config)
        self.delay = delay
        self.reading = asyncio.Event()
        #: ``drain``: a transfer, once it reached the data plane, still happens when its caller is
        #: cancelled, and only then does the cancellation go through (queued device copies behave so).
        self.drain = drain
        #: ``times_out``: the hold counts against the transfer's ``timeout``, which then fails as the
        #: real data plane's does (TransferTimeoutError), instead of being held in full.
        self.times_out = times_out
        self.landed_at: list[float] = []  # time.monotonic() of each transfer's end
        self.in_flight = 0  # transfers the caller has not got back from yet
        #: ``in_flight`` at each deregistration (memory released under a transfer: a non-zero entry)
        self.in_flight_at_deregister: list[int] = []
        #: ``unfenced``: a READ cancelled during the hold ends as the real data plane's does when its peer
        #: stays stalled past the fence budget (CancelledError(UNFENCED_CANCEL), counted).
        self.unfenced = unfenced
        #: With ``unfenced``: how long the cancelled READ waits for its operation before it says so (the real
        #: data plane's fence budget; a cancel does not cut it short).
        self.fence_seconds = fence_seconds
        #: ``fail_first``: the first transfer fails by itself after that many seconds (TransferFailedError, as
        #: when its peer's connection breaks), while the others are held as above.
        self.fail_first = fail_first
        #: ``unfenced_first``: with ``fail_first``, that failure is unfenced (TransferUnfencedError: its operation
        #: still in flight after the fence budget, watched in ``unfenced_ops``).
        self.unfenced_first = unfenced_first
        #: What each READ cancelled unfenced left in flight; a test ends one (``ended = True``) where the real
        #: data plane would see its operation end.
        self.unfenced_ops: list[UnfencedOp] = []
        self.looks = 0  # calls of unfenced_live(): the sidecar looking again at what it holds

    def register(self, table: Any, mem_type: MemType = "DRAM") -> Registration:
        return self.inner.register(table, mem_type)

    def deregister(self, registration: Registration) -> None:
        self.in_flight_at_deregister.append(self.in_flight)
        self.inner.deregister(registration)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    async def transfer(
        self, op: Op, local: Any, remote: Any, peer: str, *, timeout: float, notify: bytes | None = None,
        mem_type: MemType = "DRAM", remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:  # fmt: skip
        self.in_flight += 1
        try:
            return await self._transfer(op, local, remote, peer, timeout=timeout, notify=notify, mem_type=mem_type,
                                        remote_mem_type=remote_mem_type)  # fmt: skip
        finally:
            self.in_flight -= 1

    async def _transfer(
        self, op: Op, local: Any, remote: Any, peer: str, *, timeout: float, notify: bytes | None,
        mem_type: MemType, remote_mem_type: MemType,
    ) -> TransferResult:  # fmt: skip
        self.reading.set()
        if self.fail_first is not None:
            after, self.fail_first = self.fail_first, None
            await asyncio.sleep(after)
            if self.unfenced_first:
                self._count_unfenced(op, peer)
                self.unfenced_ops.append(UnfencedOp(op, peer))
                raise TransferUnfencedError(f"{op} failed: the connection broke; still in flight after the fence "
                                            "budget, so its bytes may still land", backend="nixl", peer=peer,
                                            unfenced=self.unfenced_ops[-1])  # fmt: skip
            raise TransferFailedError(f"{op} failed: the connection broke", backend="nixl", peer=peer)

        async def held() -> TransferResult:
            if self.times_out and self.delay >= timeout:
                await asyncio.sleep(timeout)
                raise TransferTimeoutError(f"READ did not complete within {timeout:.3f}s; cancelled", backend="nixl",
                                           peer=peer)  # fmt: skip
            try:
                await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                if not self.unfenced:
                    raise
                fence = asyncio.ensure_future(asyncio.sleep(self.fence_seconds))
                while not fence.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(fence)
                self._count_unfenced(op, peer)
                self.unfenced_ops.append(UnfencedOp(op, peer))
                raise asyncio.CancelledError(UNFENCED_CANCEL, self.unfenced_ops[-1]) from None
            try:
                return await self.inner.transfer(op, local, remote, peer, timeout=timeout, notify=notify,
                                                 mem_type=mem_type, remote_mem_type=remote_mem_type)  # fmt: skip
            finally:
                self.landed_at.append(time.monotonic())

        if not self.drain:
            return await held()
        task = asyncio.ensure_future(held())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(task)
            raise

    def poll_notifications(self) -> list[Notification]:
        return self.inner.poll_notifications()

    def unfenced_live(self) -> int:
        self.looks += 1
        return sum(not op.ended for op in self.unfenced_ops)

    def close(self) -> None:
        self.inner.close()


async def push_transfer(
    pw: Sequence[Worker], ps: Sequence[Sidecar], dw: Sequence[Worker], rid: str, p_blocks: Blocks, d_blocks: Blocks,
    salt: int, *, offer_first: bool = True, **pull_kw: Any,
) -> list[PullResult]:  # fmt: skip
    """Push mode: offer on every decode rank (before or after the prefill publishes), verify every byte."""
    for w in dw:
        w.poison(d_blocks)
    for w in pw:
        w.fill(p_blocks, salt)
    addresses = [s.peer_address for s in ps]
    pulls = [asyncio.ensure_future(w.client.pull(rid, addresses, d_blocks, push=True, **pull_kw)) for w in dw]
    if offer_first:
        await asyncio.sleep(0.2)  # the offers reach the prefill side before the publish
    for w in pw:
        await w.client.publish(rid, p_blocks)
    results = await asyncio.gather(*pulls)
    for w in dw:
        checked, bad = w.verify(d_blocks, salt)
        assert bad == 0, f"{bad} of {checked} bytes differ on decode rank {w.rank.tp_rank}"
    return list(results)


def peer_lookups(prefill: Sidecar) -> list[str]:
    """The request ids that peer lookups (GetPublished, GetPublishedBatch) reaching ``prefill`` ask for."""
    assert prefill.core is not None
    asked: list[str] = []
    answer, answer_batch = prefill.core.peer_get_published, prefill.core.peer_get_published_batch

    async def counted(req: Any, *args: Any) -> Any:
        asked.append(req.request_id)
        return await answer(req, *args)

    async def counted_batch(req: Any, *args: Any) -> Any:
        asked.extend(r.request_id for r in req.requests)
        return await answer_batch(req, *args)

    prefill.core.peer_get_published = counted  # type: ignore[method-assign]
    prefill.core.peer_get_published_batch = counted_batch  # type: ignore[method-assign]
    return asked


def agent_on(dp: DelayedDataPlane) -> WorkerAgent:
    """A worker's data-plane agent whose transfers go through ``dp`` (a FAULT INJECTOR: it holds them)."""
    agent = WorkerAgent()
    agent.transport.close()
    agent.transport = dp
    return agent


async def agent_reads(agent: WorkerAgent, job_id: int, address: int = 4096, timeout: float = 10.0) -> None:
    """Hand ``agent`` a 64-byte READ job at ``address`` and return once its data plane holds it."""
    desc = np.array([[address, 64, 0]], dtype=np.uint64).astype("<u8").tobytes()
    read = local_pb2.AgentTransfer(op="READ", local=desc, remote=desc, peer="p", timeout_seconds=timeout)
    agent._run(local_pb2.AgentJob(id=job_id, transfer=read))
    dp = agent.transport
    assert isinstance(dp, DelayedDataPlane)
    await asyncio.wait_for(dp.reading.wait(), 5)


async def gone_worker_released(sidecar: Sidecar, dp: DelayedDataPlane) -> list[int]:
    """Tell ``sidecar`` its worker is gone (as when the worker's socket closes) and return ``dp``'s count of
    transfers in flight at each deregistration that followed (asserting there was one)."""
    core = sidecar.core
    assert core is not None
    reg = core.registry.registration
    assert reg is not None
    await core.worker_gone(reg.epoch)
    at_deregister = dp.in_flight_at_deregister
    assert at_deregister, "the gone worker's memory was not released"
    return at_deregister
