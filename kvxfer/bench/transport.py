"""Data-plane benchmark: the same 256 MiB moved four ways in one run, across two processes.

(a) raw: one descriptor through the library's own API (NIXL agent / Mooncake engine), no kvxfer;
(b) kvxfer: TransferTopology's coalesced descriptors for a fragmented block list (16 KiB pages,
    runs of 1 to 64 blocks) through kvxfer.transport, descriptor building included;
(c) per-block: one descriptor per block per layer through kvxfer.transport;
(d) memcpy: a numpy copy of the same bytes in this process.
Every transfer is verified byte for byte. The four cases take turns for ``repeat`` rounds after
one untimed transfer each (connection set-up); each case's best round counts.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo, RegionTable, TransferTopology
from kvxfer.transport import Transport, TransportConfig, create_transport

PAGE_BYTES = 16 * 1024
U8 = npt.NDArray[np.uint8]


def bench_layout(size_mib: int, layers: int) -> KVCacheLayout:
    """16 KiB pages (4 kv heads x 16 tokens x head size 64, K and V packed, bf16), ``size_mib`` in all."""
    blocks = size_mib * 1024 * 1024 // (layers * PAGE_BYTES)
    lay = KVCacheLayout.attention(num_layers=layers, num_blocks=blocks, block_size=16, num_kv_heads=4, head_size=64)
    assert lay.page_bytes == PAGE_BYTES
    return lay


def fragmented_blocks(num_blocks: int, rng: np.random.Generator, max_run: int = 64) -> npt.NDArray[np.int64]:
    """Remote block ids for local blocks 0..n-1: runs of 1..max_run contiguous ids, runs shuffled."""
    cuts: list[int] = [0]
    while cuts[-1] < num_blocks:
        cuts.append(min(num_blocks, cuts[-1] + int(rng.integers(1, max_run + 1))))
    runs = [np.arange(a, b) for a, b in itertools.pairwise(cuts)]
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order]).astype(np.int64)


def _contiguous(layout: KVCacheLayout, seed: int | None) -> U8:
    if seed is None:
        return np.zeros(layout.total_bytes, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, layout.total_bytes, dtype=np.uint8)


def _table(layout: KVCacheLayout, buf: U8) -> RegionTable:
    base = buf.ctypes.data
    return RegionTable.for_layout(layout, [base + i * layout.region_bytes for i in range(layout.num_regions)])


def _peer(conn: Connection, backend: str, size_mib: int, layers: int, seed: int) -> None:
    """Hold a seeded cache as one registered buffer; answer with metadata and its address."""
    layout = bench_layout(size_mib, layers)
    buf = _contiguous(layout, seed)
    transport = create_transport(backend, f"bench-peer-{backend}", TransportConfig())
    # One registration for the whole buffer: the raw single descriptor spans every layer, and
    # kvxfer's per-layer descriptors fall inside it as well.
    whole = RegionTable(np.array([buf.ctypes.data], np.uint64), np.array([buf.size], np.uint64), np.zeros(1, np.uint64))
    transport.register(whole)
    conn.send((transport.metadata(), buf.ctypes.data, getattr(transport, "session", "")))
    conn.recv()  # wait for "exit"
    transport.close()


class _RawNixl:
    """One descriptor through NIXL's own Python API with its default agent settings."""

    persistent = False  # its progress thread spins a core: one agent per round, gone before (b)-(d)

    def __init__(self, local: U8, peer_metadata: bytes, peer_session: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvxfer.transport.nixl_agent import nixl_logs_to_stderr

        nixl_logs_to_stderr()
        self.local = local
        self.agent: Any = nixl_agent("bench-raw", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(np.array([[local.ctypes.data, local.size, 0]], dtype=np.uint64), "DRAM")
        self.peer = self.agent.add_remote_agent(peer_metadata)

    def read(self, remote_addr: int) -> None:
        n = self.local.size
        ld = self.agent.get_xfer_descs(np.array([[self.local.ctypes.data, n, 0]], dtype=np.uint64), "DRAM")
        rd = self.agent.get_xfer_descs(np.array([[remote_addr, n, 0]], dtype=np.uint64), "DRAM")
        h = self.agent.initialize_xfer("READ", ld, rd, self.peer)
        state = self.agent.transfer(h)
        while state == "PROC":
            time.sleep(50e-6)
            state = self.agent.check_xfer_state(h)
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in {state}")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent = None
        gc.collect()


class _RawMooncake:
    """One descriptor through the Mooncake engine's own synchronous READ."""

    persistent = True

    def __init__(self, local: U8, peer_metadata: bytes, peer_session: str) -> None:
        from mooncake.engine import TransferEngine

        from kvxfer.ports import free_port

        self.local = local
        self.agent: Any = TransferEngine()
        self.agent.initialize(f"127.0.0.1:{free_port('127.0.0.1', below_ephemeral=True)}", "P2PHANDSHAKE", "tcp", "")
        self.agent.register_memory(local.ctypes.data, local.size)
        self.peer = peer_session

    def read(self, remote_addr: int) -> None:
        rc = self.agent.batch_transfer_sync_read(self.peer, [self.local.ctypes.data], [remote_addr], [self.local.size])
        if rc != 0:
            raise RuntimeError(f"raw Mooncake READ returned {rc}")

    def close(self) -> None:
        self.agent.unregister_memory(self.local.ctypes.data)


# Case (a) talks to each library directly, so it has one reader per backend name.
RAW_READERS: dict[str, type[_RawNixl] | type[_RawMooncake]] = {
    "nixl": _RawNixl,
    "mooncake": _RawMooncake,
}


def run(backend: str = "nixl", size_mib: int = 256, layers: int = 16, repeat: int = 5, seed: int = 1) -> dict[str, Any]:
    """Run (a)-(d) and return figures, ratios and whether every byte matched."""
    # Both processes talk over loopback, where UCX's EFA module has nothing to do; loaded, it brings
    # a second libnl whose exit-time destructor crashes the process (docs/sidecar.md). Set before
    # NIXL loads here and inherited by the peer.
    os.environ.setdefault("UCX_MODULES", "^efa")
    layout = bench_layout(size_mib, layers)
    rng = np.random.default_rng(seed)
    local_ids = np.arange(layout.num_blocks, dtype=np.int64)
    remote_ids = fragmented_blocks(layout.num_blocks, rng)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, backend, size_mib, layers, seed), daemon=True)
    proc.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("benchmark peer did not start")
        peer_md, peer_addr, peer_session = conn.recv()
        return _measure(backend, layout, local_ids, remote_ids, peer_md, int(peer_addr), peer_session, repeat, seed)
    finally:
        conn.send("exit")
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _measure(
    backend: str,
    layout: KVCacheLayout,
    local_ids: npt.NDArray[np.int64],
    remote_ids: npt.NDArray[np.int64],
    peer_md: bytes,
    peer_addr: int,
    peer_session: str,
    repeat: int,
    seed: int,
) -> dict[str, Any]:
    source = _contiguous(layout, seed)  # what the peer holds (same seed)
    nbytes = source.size
    pages = source.reshape(layout.num_layers, layout.num_blocks, layout.page_bytes)
    expected_frag = pages[:, remote_ids, :].reshape(-1)
    local = np.zeros(nbytes, dtype=np.uint8)

    transport: Transport = create_transport(backend, f"bench-kvxfer-{backend}", TransportConfig())
    local_table = _table(layout, local)
    transport.register(local_table)
    peer = transport.add_peer(peer_md)
    remote_table = RegionTable.for_layout(
        layout, [peer_addr + i * layout.region_bytes for i in range(layout.num_regions)]
    )
    topo = TransferTopology(layout, layout, RankInfo(0, 1), 1)
    stats: dict[str, int] = {}
    loop = asyncio.new_event_loop()  # one loop for every transfer, as in the sidecar

    def kvxfer_pull() -> None:
        plan = topo.plan(local_ids, remote_ids)
        (rp,) = plan.per_rank
        ld, rd = rp.descriptors(local_table, remote_table)
        stats["descriptors"] = int(ld.shape[0])
        loop.run_until_complete(transport.read(peer, ld, rd, timeout=120))

    # (c) one descriptor per block per layer, same block list, built once (not timed).
    layer_base = local_table.base[:, None] + local_ids[None, :].astype(np.uint64) * np.uint64(layout.page_bytes)
    remote_base = remote_table.base[:, None] + remote_ids[None, :].astype(np.uint64) * np.uint64(layout.page_bytes)
    n_pb = layer_base.size
    ld_pb = np.stack([layer_base.ravel(), np.full(n_pb, layout.page_bytes, np.uint64), np.zeros(n_pb, np.uint64)], 1)
    rd_pb = np.stack([remote_base.ravel(), np.full(n_pb, layout.page_bytes, np.uint64), np.zeros(n_pb, np.uint64)], 1)

    def per_block() -> None:
        loop.run_until_complete(transport.read(peer, ld_pb, rd_pb, timeout=300))

    # Connections are set up lazily, on a first transfer: do that outside the timings.
    kvxfer_pull()
    make_raw = RAW_READERS[backend]
    raw = make_raw(local, peer_md, peer_session) if make_raw.persistent else None
    if raw is not None:
        raw.read(peer_addr)
    seconds: dict[str, list[float]] = {"raw": [], "kvxfer": [], "per_block": [], "memcpy": []}
    verified = True
    # The cases take turns, round after round, so that a burst of load from other processes on
    # this machine hits all of them alike rather than one case's whole series.
    for _ in range(repeat):
        round_raw = raw or make_raw(local, peer_md, peer_session)
        if raw is None:
            round_raw.read(peer_addr)
        local[:] = 0
        seconds["raw"].append(_timed(lambda r=round_raw: r.read(peer_addr)))  # type: ignore[misc]
        verified &= bool(np.array_equal(local, source))
        if raw is None:
            round_raw.close()
        local[:] = 0
        seconds["kvxfer"].append(_timed(kvxfer_pull))
        verified &= bool(np.array_equal(local, expected_frag))
        local[:] = 0
        seconds["per_block"].append(_timed(per_block))
        verified &= bool(np.array_equal(local, expected_frag))
        seconds["memcpy"].append(_timed(lambda: np.copyto(local, source)))
        verified &= bool(np.array_equal(local, source))
    if raw is not None:
        raw.close()
    transport.close()
    loop.close()

    runs = {case: [nbytes / t / 1e9 for t in ts] for case, ts in seconds.items()}
    out: dict[str, Any] = {
        "backend": backend,
        "bytes": nbytes,
        "page_bytes": layout.page_bytes,
        "layers": layout.num_layers,
        "blocks": layout.num_blocks,
        "rounds": repeat,
        "descriptors_raw": 1,
        "descriptors_kvxfer": stats["descriptors"],
        "descriptors_per_block": n_pb,
        "gbps_raw": max(runs["raw"]),
        "gbps_kvxfer": max(runs["kvxfer"]),
        "gbps_per_block": max(runs["per_block"]),
        "gbps_memcpy": max(runs["memcpy"]),
        "runs_gbps": runs,
        "verified": verified,
    }
    out["ratio_kvxfer_raw"] = out["gbps_kvxfer"] / out["gbps_raw"]
    out["ratio_kvxfer_per_block"] = out["gbps_kvxfer"] / out["gbps_per_block"]
    out["ratio_kvxfer_memcpy"] = out["gbps_kvxfer"] / out["gbps_memcpy"]
    return out


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
