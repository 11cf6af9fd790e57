#!/usr/bin/env python3
"""What a DRAM READ costs the event loop, posted on the loop or from the transport's own thread.

NIXL's UCX backend copies a same-host DRAM READ inside the post (cross-memory attach), so a READ
posted from the sidecar's event loop holds up every other call for its copy. ``NixlTransport``
posts one of at least ``TransportConfig.nixl_thread_post_bytes`` from a thread of its own instead
(docs/transports.md). This script reads from a publisher in a second process (its own NIXL agent,
as a prefill sidecar's) into this one, contiguous pulls of a KV cache's pages (one descriptor per
layer), each size both ways, interleaved, every byte verified:

* ``loop_cpu_us``: CPU time of the loop's thread per READ (what the loop cannot spend on other calls);
* ``wall_us``: per READ, from the call to its end;
* ``max_lag_ms``: the longest a 1 ms heartbeat on the loop came late while the READs ran.

    .venv/bin/python bench/dram_post.py [--sizes-kib 256,1024,4096,16384,65536] [--reps 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo, RegionTable, TransferTopology
from kvxfer.transport import TransportConfig, create_transport

LAYERS = 4
MODES = {"loop": 0, "thread": 1}  # nixl_thread_post_bytes: 0 posts on the loop, 1 posts every READ from the thread


def _layout(blocks: int) -> KVCacheLayout:
    # 64 KiB pages (16 tokens x 8 heads x 128 x fp16, K and V): a block of 4 layers is 256 KiB.
    return KVCacheLayout.attention(num_layers=LAYERS, num_blocks=blocks, block_size=16, num_kv_heads=8, head_size=128)


def _regions(lay: KVCacheLayout, seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, lay.region_bytes, dtype=np.uint8) if seed is not None
        else np.zeros(lay.region_bytes, dtype=np.uint8)
        for _ in range(lay.num_regions)
    ]  # fmt: skip


def _publisher(conn: Connection, blocks: int) -> None:
    """The remote side: a seeded cache registered with its own agent; lives until told to stop."""
    lay = _layout(blocks)
    regions = _regions(lay, seed=5)
    table = RegionTable.for_layout(lay, [r.ctypes.data for r in regions])
    transport = create_transport("nixl", f"dram-post-publisher-{os.getpid()}", TransportConfig())
    transport.register(table)
    conn.send((transport.metadata(), table.base.tolist()))
    conn.recv()
    transport.close()


async def _measure(transport: Any, peer: str, ld: np.ndarray, rd: np.ndarray, reps: int) -> dict[str, float]:
    loop_cpu, walls, lag = [], [], 0.0
    running = True

    async def heartbeat() -> None:
        nonlocal lag
        while running:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - t - 0.001)

    beat = asyncio.ensure_future(heartbeat())
    await asyncio.sleep(0.005)
    for _ in range(reps):
        c0, w0 = time.thread_time(), time.perf_counter()
        task = asyncio.ensure_future(transport.read(peer, ld, rd, timeout=60))
        # The loop's own share: the READ's steps on this thread (time.thread_time counts only this thread).
        await task
        walls.append(time.perf_counter() - w0)
        loop_cpu.append(time.thread_time() - c0)
        await asyncio.sleep(0.002)
    running = False
    await beat
    return {"loop_cpu_us": float(np.median(loop_cpu)) * 1e6, "wall_us": float(np.median(walls)) * 1e6,
            "max_lag_ms": lag * 1e3}  # fmt: skip


def run(sizes_kib: list[int], reps: int) -> dict[str, Any]:
    """Every size, both ways, interleaved; the figures and the bytes checked."""
    block_bytes = 64 * 1024 * LAYERS
    blocks = max(max(sizes_kib) * 1024 // block_bytes, 1)
    lay = _layout(blocks)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_publisher, args=(there, blocks), daemon=True)
    proc.start()
    metadata, bases = here.recv()
    remote = RegionTable.for_layout(lay, bases)
    expected = _regions(lay, seed=5)
    transports = {m: create_transport("nixl", f"dram-post-{m}-{os.getpid()}",
                                      TransportConfig(nixl_thread_post_bytes=least))
                  for m, least in MODES.items()}  # fmt: skip
    mine = {m: _regions(lay, seed=None) for m in MODES}
    tables = {m: RegionTable.for_layout(lay, [r.ctypes.data for r in mine[m]]) for m in MODES}
    peers = {}
    for m, t in transports.items():
        t.register(tables[m])
        peers[m] = t.add_peer(metadata)
    rows: list[dict[str, Any]] = []
    mismatched = 0
    try:
        for kib in sizes_kib:
            n = max(kib * 1024 // block_bytes, 1)
            ids = np.arange(n)
            (rp,) = TransferTopology(lay, lay, RankInfo(0, 1), 1).plan(ids, ids).per_rank
            for m in MODES:
                ld, rd = rp.descriptors(tables[m], remote)
                for r in mine[m]:
                    r[:] = 0
                figures = asyncio.run(_measure(transports[m], peers[m], ld, rd, reps))
                page = lay.page_bytes
                mismatched += sum(int(np.count_nonzero(mine[m][k][: n * page] != expected[k][: n * page]))
                                  for k in range(LAYERS))  # fmt: skip
                rows.append({"kib": kib, "mode": m, "descriptors": int(ld.shape[0]),
                             "thread_posts": transports[m].thread_posts, **figures})  # type: ignore[attr-defined]  # fmt: skip
    finally:
        for t in transports.values():
            t.close()
        here.send("stop")
        proc.join(30)
    return {"reps": reps, "rows": rows, "mismatched_bytes": mismatched}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="256,1024,4096,16384,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.sizes_kib.split(",") if x]
    except ValueError:
        ap.error(f"--sizes-kib: comma-separated KiB, got {a.sizes_kib!r}")
    if not sizes or min(sizes) < 256 or a.reps < 1:
        ap.error("--sizes-kib: each at least 256 (one block of the cache); --reps: at least 1")
    r = run(sizes, a.reps)
    if a.json:
        print(json.dumps(r))
        return 0 if r["mismatched_bytes"] == 0 else 1
    print(f"DRAM READs from a second process, median of {r['reps']} each: posted on the loop vs from its thread")
    print(f"{'size':>10} {'mode':>7} {'loop CPU/READ':>14} {'wall/READ':>11} {'max loop lag':>13}")
    for row in r["rows"]:
        print(f"{row['kib']:>7} KiB {row['mode']:>7} {row['loop_cpu_us']:>11.0f} us {row['wall_us']:>8.0f} us "
              f"{row['max_lag_ms']:>10.2f} ms")  # fmt: skip
    print(f"mismatched bytes: {r['mismatched_bytes']}")
    return 0 if r["mismatched_bytes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
