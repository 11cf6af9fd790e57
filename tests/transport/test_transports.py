"""Real NIXL and Mooncake agents in two processes: exact bytes, notifications, a killed peer."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import numpy as np
import pytest

from kvxfer.errors import Reason
from kvxfer.topology import RankInfo, RegionTable, TransferTopology
from kvxfer.transport import (
    PeerUnknownError,
    Registration,
    TransferFailedError,
    TransferTimeoutError,
    TransferUnfencedError,
    Transport,
    TransportConfig,
    TransportError,
    available_transports,
    create_transport,
)
from kvxfer.transport.cuda_ipc_direct import CudaIpcDirect

from .peer import Cache, cache_layout, serve

BACKENDS = ["nixl", "mooncake"]
CTX = mp.get_context("spawn")


class Peer:
    def __init__(self, backend: str, name: str, seed: int) -> None:
        self.conn, child = CTX.Pipe()
        self.proc: BaseProcess = CTX.Process(target=serve, args=(child, backend, name, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "peer did not start within 60 s"
        self.metadata, bases = self.conn.recv()
        self.table = RegionTable.for_layout(cache_layout(), bases)
        self.expected = Cache(cache_layout(), seed)  # same seed: what the peer holds

    def ask(self, cmd: str, arg: object = None, within: float = 30) -> object:
        self.conn.send((cmd, arg))
        assert self.conn.poll(within), f"peer did not answer {cmd!r}"
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.pid and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(AssertionError, OSError, EOFError):
                self.ask("exit", within=10)
        self.kill()


def freeze(pid: int) -> None:
    """SIGSTOP a process and wait until every one of its threads is stopped.

    The signal only takes effect when each thread next enters the kernel; on a busy VM a running
    thread can answer one more READ first, and a test that then expects a stall sees it complete.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = f"/proc/{pid}/task"
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(tasks):
            with contextlib.suppress(FileNotFoundError), open(f"{tasks}/{tid}/stat") as f:
                # the state follows the command name, which is in parentheses and may hold spaces
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within 10 s: thread states {states}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def local(backend: str) -> Iterator[tuple[Transport, Cache]]:
    transport = create_transport(backend, f"local-{backend}-{os.getpid()}", TransportConfig())
    cache = Cache(cache_layout(), seed=None)
    transport.register(cache.table)
    yield transport, cache
    transport.close()


@pytest.fixture
def peer(backend: str) -> Iterator[Peer]:
    p = Peer(backend, f"peer-{backend}-{time.monotonic_ns()}", seed=7)
    yield p
    p.stop()


FRAGMENTED_LOCAL = np.array([3, 4, 5, 9, 10, 30, 31, 32, 33, 60, 0, 1])
FRAGMENTED_REMOTE = np.array([50, 51, 52, 7, 8, 9, 10, 11, 40, 2, 3, 62])


def descriptors(local_cache: Cache, peer: Peer) -> tuple[np.ndarray, np.ndarray, int]:
    lay = cache_layout()
    plan = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(FRAGMENTED_LOCAL, FRAGMENTED_REMOTE)
    (rp,) = plan.per_rank
    ld, rd = rp.descriptors(local_cache.table, peer.table)
    return ld, rd, plan.num_descriptors


def test_registry_names_both_backends_and_refuses_unknown() -> None:
    assert available_transports() == ["mooncake", "nixl", "worker"]
    with pytest.raises(TransportError, match="unknown backend 'rdma-magic'; available: mooncake, nixl, worker"):
        create_transport("rdma-magic", "x")


def test_read_fragmented_blocks_exact_bytes_and_one_notification(
    backend: str, local: tuple[Transport, Cache], peer: Peer
) -> None:
    transport, cache = local
    name = transport.add_peer(peer.metadata)
    ld, rd, n = descriptors(cache, peer)
    # runs contiguous on both sides: 3-5|50-52, 9-10|7-8, 30-32|9-11, 33|40, 60|2, 0|3, 1|62
    assert n == 4 * 7
    result = asyncio.run(transport.read(name, ld, rd, timeout=30, notify=b"req-1:done"))
    assert result.bytes == 4 * len(FRAGMENTED_LOCAL) * cache_layout().page_bytes
    for layer in range(4):
        for lb, rb in zip(FRAGMENTED_LOCAL, FRAGMENTED_REMOTE, strict=True):
            assert bytes(cache.page(layer, lb)) == bytes(peer.expected.page(layer, rb)), (layer, lb, rb)
    untouched = sorted(set(range(64)) - set(FRAGMENTED_LOCAL.tolist()))
    assert all(not cache.page(0, b).any() for b in untouched)
    notes = peer.ask("notifications", 1.0)
    assert notes == [(transport.agent_name, b"req-1:done")]
    assert peer.ask("notifications", 0.3) == []


def test_write_fragmented_blocks_land_exactly(backend: str, local: tuple[Transport, Cache], peer: Peer) -> None:
    transport, cache = local
    rng = np.random.default_rng(3)
    for region in cache.regions:
        region[:] = rng.integers(0, 256, region.size, dtype=np.uint8)
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.transfer("WRITE", ld, rd, name, timeout=30, notify=b"w"))
    pages = peer.ask("pages", [(layer, int(rb)) for layer in range(4) for rb in FRAGMENTED_REMOTE])
    expected = [bytes(cache.page(layer, int(lb))) for layer in range(4) for lb in FRAGMENTED_LOCAL]
    assert pages == expected
    # a block the request did not name is still the peer's own data
    (untouched,) = peer.ask("pages", [(0, 20)])  # type: ignore[misc]
    assert untouched == bytes(peer.expected.page(0, 20))


def test_unknown_peer_is_refused(backend: str, local: tuple[Transport, Cache]) -> None:
    transport, cache = local
    d = np.array([[cache.table.base[0], 16, 0]], dtype=np.uint64)
    with pytest.raises(PeerUnknownError, match="'nobody': peer was never added"):
        asyncio.run(transport.read("nobody", d, d, timeout=1))


def test_killed_peer_fails_within_timeout_and_agent_serves_another(
    backend: str, local: tuple[Transport, Cache], peer: Peer
) -> None:
    transport, cache = local
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    peer.kill()
    t0 = time.monotonic()
    with pytest.raises((TransferFailedError, TransferTimeoutError)) as err:
        asyncio.run(transport.read(name, ld, rd, timeout=5))
    assert time.monotonic() - t0 < 5 + 2
    assert name in str(err.value)
    transport.remove_peer(name)
    other = Peer(backend, f"other-{backend}-{time.monotonic_ns()}", seed=11)
    try:
        name2 = transport.add_peer(other.metadata)
        ld2, rd2, _ = descriptors(cache, other)
        asyncio.run(transport.read(name2, ld2, rd2, timeout=30))
        assert bytes(cache.page(2, 60)) == bytes(other.expected.page(2, 2))
    finally:
        other.stop()


def _pieces(descs: np.ndarray, piece: int) -> np.ndarray:
    """Split every descriptor into ``piece``-byte descriptors (lengths must be multiples of it)."""
    n = descs[:, 1] // np.uint64(piece)
    starts = np.repeat(descs[:, 0], n.astype(np.int64))
    first = np.repeat(np.cumsum(n) - n, n.astype(np.int64))
    k = np.arange(starts.size, dtype=np.uint64) - first.astype(np.uint64)
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0] = starts + k * np.uint64(piece)
    out[:, 1] = piece
    out[:, 2] = np.repeat(descs[:, 2], n.astype(np.int64))
    return out


def test_notifications_arrive_exactly_once_per_transfer(
    backend: str, local: tuple[Transport, Cache], peer: Peer
) -> None:
    transport, cache = local
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    lp, rp = _pieces(ld, 512), _pieces(rd, 512)
    # 12 blocks x 4 layers x 32 pieces: 1536 descriptors, two Mooncake batches; the notice rides once
    assert lp.shape == (1536, 3)

    async def run() -> None:
        await transport.read(name, ld, rd, timeout=30, notify=b"a")
        await transport.transfer("WRITE", ld, rd, name, timeout=30, notify=b"b")
        cache.regions[1][:] = 0
        await transport.read(name, lp, rp, timeout=30, notify=b"c")
        await transport.read(name, ld, rd, timeout=30)  # no notice

    asyncio.run(run())
    # layer 1 was zeroed, then filled again by the 512-byte pieces alone
    for lb, rb in zip(FRAGMENTED_LOCAL, FRAGMENTED_REMOTE, strict=True):
        assert bytes(cache.page(1, lb)) == bytes(peer.expected.page(1, rb))
    notes = peer.ask("notifications", 1.0)
    assert sorted(notes) == [(transport.agent_name, b"a"), (transport.agent_name, b"b"), (transport.agent_name, b"c")]  # type: ignore[arg-type]
    assert peer.ask("notifications", 0.5) == []


def test_forgotten_peer_is_refused_until_added_again(backend: str, local: tuple[Transport, Cache], peer: Peer) -> None:
    transport, cache = local
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    transport.remove_peer(name)
    transport.remove_peer(name)  # forgetting twice is not an error
    with pytest.raises(PeerUnknownError) as err:
        asyncio.run(transport.read(name, ld, rd, timeout=5))
    assert str(err.value) == f"{backend} peer {name!r}: peer was never added (or was removed)"
    assert err.value.status == "FAILED_PRECONDITION"
    assert transport.add_peer(peer.metadata) == name
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    assert bytes(cache.page(3, 33)) == bytes(peer.expected.page(3, 40))


def test_deregistered_memory_cannot_be_read_and_registering_again_restores_it(
    backend: str, local: tuple[Transport, Cache], peer: Peer
) -> None:
    transport, cache = local
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    assert transport.add_peer(peer.ask("deregister")) == name  # type: ignore[arg-type]
    # Mooncake fails some of the refused transfers and may leave the others pending past the fence
    # budget (seen: 8 of 28 after 5 s): the library never said they ended, so the READ is unfenced.
    with pytest.raises((TransferFailedError, TransferUnfencedError)) as err:
        asyncio.run(transport.read(name, ld, rd, timeout=10))
    text = str(err.value)
    # which backend and peer, which local regions and addresses, and what the library said
    assert text.startswith(f"{backend} peer {name!r}: ")
    assert f"READ of 28 descriptors ({4 * 12 * 16384} B) into local regions 0-3 of 4 [" in text
    assert "(library: " in text
    for region in cache.regions:
        region[:] = 0
    assert transport.add_peer(peer.ask("register")) == name  # type: ignore[arg-type]
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    assert bytes(cache.page(0, 3)) == bytes(peer.expected.page(0, 50))


@pytest.fixture
def fence_budget() -> float:
    """The silent peers' tests' fence budget: short, as their peers stay stopped (a test parametrizes its own)."""
    return 0.3


def read_then_freeze(transport: Transport, cache: Cache, peer: Peer) -> tuple[str, np.ndarray, np.ndarray]:
    """Add ``peer``, READ its blocks once (the connection is up), then stop it: (peer name, local, remote)."""
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    assert peer.proc.pid
    freeze(peer.proc.pid)
    return name, ld, rd


def until_none_unfenced(transport: Transport, within: float = 10.0) -> None:
    """Wait (up to ``within`` seconds) until the transport has seen every unfenced operation end."""
    deadline = time.monotonic() + within
    while transport.unfenced_live() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture
def silent_capable(
    backend: str, fence_budget: float, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Transport, Cache, Peer]]:
    """A local agent and a peer whose transfers need the peer's help, so that stopping it stalls them.

    On one host UCX reads a peer's memory by cross-memory attach, without the peer; UCX_TLS=tcp (set
    before both agents exist) makes NIXL go through the peer's socket as it would across hosts.
    """
    if backend == "nixl":
        monkeypatch.setenv("UCX_TLS", "tcp")
    # cuda_ipc_direct: the backend as a sidecar runs it, wrapped in the same-host shortcut (which must hand
    # on the wrapped backend's unfenced count, hook and handles).
    config = TransportConfig(fence_budget_s=fence_budget, cuda_ipc_direct=True)
    transport = create_transport(backend, f"local-{backend}-{time.monotonic_ns()}", config)
    cache = Cache(cache_layout(), seed=None)
    transport.register(cache.table)
    p = Peer(backend, f"peer-{backend}-{time.monotonic_ns()}", seed=7)
    try:
        yield transport, cache, p
    finally:
        if p.proc.pid and p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGCONT)
        p.stop()
        transport.close()


def test_silent_peer_times_out_without_spinning_and_others_are_served(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)

    async def stalled() -> tuple[TransferUnfencedError, float, float]:
        cpu, t0 = time.process_time(), time.monotonic()
        with pytest.raises(TransferUnfencedError) as err:
            await transport.read(name, ld, rd, timeout=1.5, notify=b"never")
        return err.value, time.monotonic() - t0, time.process_time() - cpu

    err, wall, cpu = asyncio.run(stalled())
    # the timeout, then the fence budget (0.3 s): the peer stays stopped, so the READ is still in flight
    assert 1.8 <= wall < 2.8
    assert str(err).startswith(f"{backend} peer {name!r}: READ of 28 descriptors ")
    assert "did not complete within 1.500s" in str(err)
    assert "may still land" in str(err)
    assert err.timed_out
    assert err.reason == Reason.DATA_PLANE_UNFENCED
    assert transport.unfenced_total == 1
    assert transport.unfenced_live() == 1
    # completion polled with a sleeping back-off (NIXL: the loop, Mooncake: a worker on a sentinel;
    # NIXL's progress thread is woken by events): nothing spins while the peer is silent
    assert cpu < 0.3 * wall, cpu

    other = Peer(backend, f"other-{backend}-{time.monotonic_ns()}", seed=11)
    try:

        async def both() -> None:
            # more stalled transfers than a peer's workers, then another peer: not queued behind them
            stuck = [asyncio.create_task(transport.read(name, ld, rd, timeout=20)) for _ in range(3)]
            await asyncio.sleep(0.2)
            name2 = transport.add_peer(other.metadata)
            ld2, rd2, _ = descriptors(cache, other)
            t0 = time.monotonic()
            await transport.read(name2, ld2, rd2, timeout=10)
            assert time.monotonic() - t0 < 5
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

        asyncio.run(both())
        assert bytes(cache.page(2, 60)) == bytes(other.expected.page(2, 2))
    finally:
        other.stop()
    # the silent peer wakes up: it is served again and sees only the notice of a completed transfer
    os.kill(peer.proc.pid, signal.SIGCONT)
    for region in cache.regions:
        region[:] = 0
    asyncio.run(transport.read(name, ld, rd, timeout=30, notify=b"after"))
    assert bytes(cache.page(1, 9)) == bytes(peer.expected.page(1, 7))
    assert (transport.agent_name, b"after") in peer.ask("notifications", 1.0)  # type: ignore[operator]


def test_cancelling_the_awaiting_task_cancels_the_transfer(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)

    async def cancel() -> float:
        task = asyncio.create_task(transport.read(name, ld, rd, timeout=30))
        await asyncio.sleep(0.3)
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    # The READ stays in flight while the peer is stopped: the cancel waits out the fence budget
    # (0.3 s) for it to end, then returns, the READ counted as unfenced.
    assert 0.3 <= asyncio.run(cancel()) < 1.0
    assert transport.unfenced_total == 1
    os.kill(peer.proc.pid, signal.SIGCONT)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    assert bytes(cache.page(0, 60)) == bytes(peer.expected.page(0, 2))


@pytest.mark.parametrize("fence_budget", [5.0])
@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_failed_read_lands_nothing_after_it_raised(
    backend: str, how: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    """A READ from a stopped peer times out (or is cancelled); the peer resumes within the fence budget.

    The error comes only once the READ ended, and the local bytes do not change after it (before the
    fence the error came at the timeout and the whole READ landed afterwards)."""
    transport, cache, peer = silent_capable
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    for region in cache.regions:
        region[:] = 0
    assert peer.proc.pid
    pid = peer.proc.pid
    freeze(pid)

    resume = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))  # whether or not the READ returned by then

    async def failed() -> float:
        t0 = time.monotonic()
        resume.start()
        task = asyncio.create_task(transport.read(name, ld, rd, timeout=1.0 if how == "timeout" else 30))
        if how == "cancel":
            await asyncio.sleep(0.5)
            assert not task.done()
            task.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancel" else TransferTimeoutError):
            await task
        return time.monotonic() - t0

    raised_after = asyncio.run(failed())
    at_error = [r.copy() for r in cache.regions]
    time.sleep(max(2.5 - raised_after, 0) + 1.0)  # past the resume, and a second more
    assert all(np.array_equal(a, r) for a, r in zip(at_error, cache.regions, strict=True)), "bytes landed late"
    # It raised once the READ ended: after the resume (nearly always), or earlier where the library
    # failed the READ by itself (Mooncake did once under load), never at the cancel or timeout itself.
    assert raised_after < 5.0
    assert transport.unfenced_total == 0
    assert transport.unfenced_live() == 0


@pytest.mark.parametrize("fence_budget", [5.0])
def test_a_timed_out_write_changes_nothing_at_the_peer_after_it_raised(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    """A WRITE into a stopped peer times out; the peer resumes within the fence budget: the peer's pages
    do not change after transfer() raised (a reader that revoked frees them then)."""
    transport, cache, peer = silent_capable
    name = transport.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(transport.read(name, ld, rd, timeout=30))
    for region in cache.regions:
        region[:] = 255 - region  # differs from every byte the peer holds
    assert peer.proc.pid
    pid = peer.proc.pid
    freeze(pid)
    resume = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
    resume.start()
    with pytest.raises(TransferTimeoutError):
        asyncio.run(transport.transfer("WRITE", ld, rd, name, timeout=1.0))
    pages = [(layer, block) for layer in range(4) for block in (int(b) for b in FRAGMENTED_REMOTE)]
    at_error = peer.ask("pages", pages)
    time.sleep(1.0)
    assert peer.ask("pages", pages) == at_error, "the WRITE landed at the peer after it raised"
    assert transport.unfenced_total == 0


def test_an_unfenced_read_is_kept_until_it_ends(backend: str, silent_capable: tuple[Transport, Cache, Peer]) -> None:
    """The peer stays stopped past the fence budget: the error says unfenced, the transport keeps the
    READ's handle, removing the peer does not lose it, and once the peer resumes it is released."""
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)
    counted: list[tuple[str, str]] = []
    transport.on_unfenced = lambda op, p: counted.append((op, p))
    with pytest.raises(TransferUnfencedError) as err:
        asyncio.run(transport.read(name, ld, rd, timeout=0.5))
    assert err.value.reason == Reason.DATA_PLANE_UNFENCED
    assert err.value.timed_out
    assert counted == [("READ", name)]
    unfenced = err.value.unfenced  # what the sidecar watches before the worker may reuse the blocks
    assert (unfenced.op, unfenced.peer, unfenced.watched, unfenced.ended) == ("READ", name, True, False)
    assert transport.unfenced_live() == 1
    transport.remove_peer(name)  # what the sidecar does after a failed READ
    assert transport.unfenced_live() == 1
    assert not unfenced.ended
    os.kill(peer.proc.pid, signal.SIGCONT)
    until_none_unfenced(transport)
    assert transport.unfenced_live() == 0
    assert unfenced.ended
    assert unfenced.watched


class _FirstTransferFails:
    """FAULT INJECTOR (not a mock): the real Mooncake engine, whose status call reports the first batch
    submitted through it failed (-1), as the engine does when one transfer fails by itself (a connection
    error) while the others stay in flight; a stopped peer cannot be made to fail one transfer alone."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.first: int | None = None

    def batch_transfer_async(self, *args: object) -> int:
        batch = int(self.engine.batch_transfer_async(*args))  # type: ignore[attr-defined]
        if self.first is None:
            self.first = batch
        return batch

    def transfer_check_status(self, batch: int) -> int:
        if batch == self.first:
            return -1
        return int(self.engine.transfer_check_status(batch))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_mooncake_transfer_failed_by_itself_with_others_in_flight_is_unfenced(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    """One of a READ's transfers fails by itself while the rest stay in flight (the peer stopped) past the
    fence budget: the READ is reported unfenced and counted, not as a plain failure (it was: the worker's
    count of transfers left in flight was dropped when one had failed)."""
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)
    engine = transport.inner if isinstance(transport, CudaIpcDirect) else transport
    engine._engine = _FirstTransferFails(engine._engine)  # type: ignore[attr-defined]
    with pytest.raises(TransferUnfencedError) as err:
        asyncio.run(transport.read(name, ld, rd, timeout=10))
    assert err.value.reason == Reason.DATA_PLANE_UNFENCED
    assert not err.value.timed_out
    assert transport.unfenced_total == 1
    assert transport.unfenced_live() == 1
    assert not err.value.unfenced.ended
    os.kill(peer.proc.pid, signal.SIGCONT)
    until_none_unfenced(transport)
    assert err.value.unfenced.ended  # every batch it left in flight was seen to end


def test_peer_killed_mid_transfer_fails_within_the_timeout(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)

    async def killed() -> float:
        task = asyncio.create_task(transport.read(name, ld, rd, timeout=10))
        await asyncio.sleep(0.5)
        assert not task.done()  # in flight when the peer dies
        t0 = time.monotonic()
        peer.kill()
        # Mooncake fails some of the dead peer's transfers and may leave the others pending past the
        # fence budget (seen: 24 of 28 after 0.3 s): the library never said they ended, so unfenced.
        with pytest.raises((TransferFailedError, TransferTimeoutError, TransferUnfencedError)) as err:
            await task
        assert name in str(err.value)
        return time.monotonic() - t0

    assert asyncio.run(killed()) < 3  # the library notices the closed connection; no wait for the timeout


def test_removing_a_peer_fails_its_transfers_with_a_transport_error(
    backend: str, silent_capable: tuple[Transport, Cache, Peer]
) -> None:
    """More transfers than a Mooncake peer has workers, so one of them waits for a worker when the peer
    is removed (the sidecar does so after another pull's READ from it failed): every one ends with a
    TransportError, none as if its caller had cancelled it (a TaskGroup takes such a READ for done)."""
    transport, cache, peer = silent_capable
    name, ld, rd = read_then_freeze(transport, cache, peer)

    async def removed() -> list[BaseException | None]:
        tasks = [asyncio.create_task(transport.read(name, ld, rd, timeout=3)) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks)
        transport.remove_peer(name)
        await asyncio.wait(tasks)
        assert not any(t.cancelled() for t in tasks)
        return [t.exception() for t in tasks]

    for err in asyncio.run(removed()):
        assert isinstance(err, TransportError), repr(err)
        assert name in str(err)


def test_a_restarted_nixl_peer_replaces_itself_only() -> None:
    """A peer restarted under its old name (a container's fixed pid) comes back with new metadata, which
    NIXL refuses to load over the old: the old is dropped, and only it, not a peer whose name is a
    prefix of the restarted one's."""
    transport = create_transport("nixl", f"local-restart-{time.monotonic_ns()}", TransportConfig())
    cache = Cache(cache_layout(), seed=None)
    transport.register(cache.table)
    base = f"dec-{time.monotonic_ns()}"
    short, long = Peer("nixl", base, seed=7), Peer("nixl", base + "0", seed=11)
    try:
        assert transport.add_peer(short.metadata) == base
        assert transport.add_peer(long.metadata) == base + "0"
        long.stop()
        long = Peer("nixl", base + "0", seed=13)  # restarted: same name, new metadata
        assert transport.add_peer(long.metadata) == base + "0"
        for p in (short, long):
            ld, rd, _ = descriptors(cache, p)
            asyncio.run(transport.read(base if p is short else base + "0", ld, rd, timeout=30))
            assert bytes(cache.page(1, 9)) == bytes(p.expected.page(1, 7))
    finally:
        short.stop()
        long.stop()
        transport.close()


def test_nixl_backend_list_is_configurable_and_missing_plugins_are_named() -> None:
    with pytest.raises(TransportError) as err:
        create_transport("nixl", f"plugins-{time.monotonic_ns()}", TransportConfig(nixl_backends=("UCX", "NOPE")))
    text = str(err.value)
    assert text.startswith("nixl: backend plugins ['NOPE'] are not available; plugins found: [")
    assert "'UCX'" in text
    assert err.value.status == "FAILED_PRECONDITION"


# ----------------------------------------------------------------- large DRAM transfers posted from a thread
def _whole_cache(local_cache: Cache, peer: Peer) -> tuple[np.ndarray, np.ndarray]:
    """Every page of the cache (4 layers x 64 blocks x 16 KiB = 4 MiB), remote block b into local 63 - b."""
    lay = cache_layout()
    ids = np.arange(lay.num_blocks)
    (rp,) = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(ids, ids[::-1].copy()).per_rank
    return rp.descriptors(local_cache.table, peer.table)


@contextlib.contextmanager
def _nixl_pair(least: int) -> Iterator[tuple[Transport, Cache, Peer, str, Registration]]:
    """A NIXL transport posting DRAM transfers of ``least`` bytes or more from its thread, and a peer."""
    transport = create_transport(
        "nixl", f"local-post-{time.monotonic_ns()}", TransportConfig(nixl_thread_post_bytes=least)
    )
    cache = Cache(cache_layout(), seed=None)
    registration = transport.register(cache.table)
    peer = Peer("nixl", f"peer-post-{time.monotonic_ns()}", seed=11)
    try:
        yield transport, cache, peer, transport.add_peer(peer.metadata), registration
    finally:
        peer.stop()
        transport.close()


@pytest.mark.parametrize("least", [4 << 20, 0])
def test_a_large_dram_read_is_copied_beside_the_event_loop(least: int) -> None:
    """NIXL copies DRAM inside the post: from 4 MiB (by default) it is posted from the transport's own
    thread, so the loop runs on while it copies; with 0, or below the threshold, it is posted on the loop."""
    with _nixl_pair(least) as (transport, cache, peer, name, _):
        ld, rd = _whole_cache(cache, peer)
        small_l, small_r, _ = descriptors(cache, peer)

        async def run() -> tuple[int, int]:
            task = asyncio.ensure_future(transport.read(name, ld, rd, timeout=30))
            await asyncio.sleep(0)  # the read's first step
            ticks = 0
            while not task.done():  # the loop's own turns while the bytes are being copied
                ticks += 1
                await asyncio.sleep(0)
            result = await task
            assert result.bytes == 4 << 20
            await transport.read(name, small_l, small_r, timeout=30)  # 448 KiB: below the threshold
            return ticks, transport.thread_posts  # type: ignore[attr-defined]

        ticks, posted = asyncio.run(run())
        if least:
            assert posted == 1  # the large read only
            assert ticks >= 1  # the read's first step handed the copy over and returned
        else:
            assert posted == 0  # (the post may still leave part of the copy to NIXL's progress thread)
        for layer in range(4):
            for b in (0, 17, 40):  # local pages the small read after it does not touch
                assert bytes(cache.page(layer, 63 - b)) == bytes(peer.expected.page(layer, b)), (layer, b)


def test_a_cancel_during_a_threaded_copy_returns_only_once_the_copy_has_ended() -> None:
    """No byte may land after a transfer's caller heard it ended (a worker frees an aborted pull's blocks).
    Named fault: the poster thread is held busy by the test, so that the cancel surely comes before the copy."""
    import threading

    with _nixl_pair(1) as (transport, cache, peer, name, _):
        ld, rd = _whole_cache(cache, peer)
        gate = threading.Event()

        async def run() -> None:
            transport._poster_thread().submit(gate.wait, 10)  # type: ignore[attr-defined]  # the fault: it is busy
            task = asyncio.ensure_future(transport.read(name, ld, rd, timeout=30))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # cancelled, but its copy has not run yet: the read waits for it
            assert not cache.page(0, 63).any()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the copy ran before the read ended, never after
            assert bytes(cache.page(0, 63)) == bytes(peer.expected.page(0, 0))

        asyncio.run(run())
        # the handle was released and the agent serves the next read
        small_l, small_r, _ = descriptors(cache, peer)
        asyncio.run(transport.read(name, small_l, small_r, timeout=30))


def test_deregistering_waits_for_a_copy_on_the_poster_thread() -> None:
    """The memory is unmapped right after (and may be mapped again at the same address): a copy into it
    ends before it is deregistered, as on the loop. Named fault: the poster thread is held busy by the
    test, so that the deregistration surely comes while the read waits for it."""
    import threading

    with _nixl_pair(1) as (transport, cache, peer, name, registration):
        ld, rd = _whole_cache(cache, peer)
        gate = threading.Event()
        transport._poster_thread().submit(gate.wait, 10)  # type: ignore[attr-defined]  # the fault: it is busy

        async def run() -> float:
            task = asyncio.ensure_future(transport.read(name, ld, rd, timeout=30))
            await asyncio.sleep(0.05)
            assert not task.done()
            threading.Timer(0.3, gate.set).start()
            t0 = time.monotonic()
            transport.deregister(registration)  # blocks until the queued copy has run
            waited = time.monotonic() - t0
            assert bytes(cache.page(0, 63)) == bytes(peer.expected.page(0, 0))  # it landed first
            await task
            return waited

        assert asyncio.run(run()) >= 0.2
