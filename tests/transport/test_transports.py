"""Real NIXL and Mooncake agents in two processes: exact bytes, notifications, a killed peer."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess

import numpy as np
import pytest

from kvxfer.topology import RankInfo, RegionTable, TransferTopology
from kvxfer.transport import (
    PeerUnknownError,
    TransferFailedError,
    TransferTimeoutError,
    Transport,
    TransportConfig,
    TransportError,
    available_transports,
    create_transport,
)

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
    assert available_transports() == ["mooncake", "nixl"]
    with pytest.raises(TransportError, match="unknown backend 'rdma-magic'; available: mooncake, nixl"):
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
