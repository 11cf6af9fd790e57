"""A transport peer in its own process, driven over a multiprocessing pipe (real library, no fakes)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RegionTable
from kvxfer.transport import TransportConfig, create_transport


def cache_layout(num_blocks: int = 64) -> KVCacheLayout:
    """4 layers x 64 blocks x 16 KiB pages (8 heads x 16 tokens x 64 bf16... packed K/V)."""
    return KVCacheLayout.attention(num_layers=4, num_blocks=num_blocks, block_size=16, num_kv_heads=4, head_size=64)


class Cache:
    """One region per layer, each its own numpy buffer, filled from a seed."""

    def __init__(self, layout: KVCacheLayout, seed: int | None) -> None:
        rng = np.random.default_rng(seed)
        self.layout = layout
        self.regions = [
            rng.integers(0, 256, layout.region_bytes, dtype=np.uint8) if seed is not None
            else np.zeros(layout.region_bytes, dtype=np.uint8)
            for _ in range(layout.num_regions)
        ]  # fmt: skip
        self.table = RegionTable.for_layout(layout, [r.ctypes.data for r in self.regions])

    def page(self, layer: int, block: int) -> np.ndarray:
        p = self.layout.page_bytes
        return self.regions[layer][block * p : (block + 1) * p]


def serve(conn: Connection, backend: str, name: str, seed: int) -> None:
    """Register a seeded cache, send (metadata, bases), then answer commands until 'exit'.

    Commands: ``notifications`` (collect for ``arg`` seconds), ``pages`` ((layer, block) list),
    ``deregister`` / ``register`` (the cache; both answer the new metadata), ``exit``.
    """
    transport = create_transport(backend, name, TransportConfig())
    cache = Cache(cache_layout(), seed)
    registration = transport.register(cache.table)
    conn.send((transport.metadata(), cache.table.base.tolist()))
    notes: list[tuple[str, bytes]] = []
    while True:
        if not conn.poll(0.01):
            notes.extend((n.peer, n.message) for n in transport.poll_notifications())
            continue
        cmd, arg = conn.recv()
        reply: Any
        if cmd == "notifications":
            deadline = time.monotonic() + float(arg)
            while time.monotonic() < deadline:
                notes.extend((n.peer, n.message) for n in transport.poll_notifications())
                time.sleep(0.01)
            reply, notes = notes, []
        elif cmd == "deregister":
            transport.deregister(registration)
            reply = transport.metadata()
        elif cmd == "register":
            registration = transport.register(cache.table)
            reply = transport.metadata()
        elif cmd == "pages":
            reply = [bytes(cache.page(layer, block)) for layer, block in arg]
        elif cmd == "exit":
            conn.send("bye")
            transport.close()
            return
        else:
            reply = f"unknown command {cmd}"
        conn.send(reply)
