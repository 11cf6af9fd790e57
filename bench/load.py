"""Many concurrent small pulls through two sidecars: requests/s and control-plane overhead.

The two sidecars run as their own processes (``python -m kvxfer.server``, real gRPC, real NIXL);
this script plays both workers. Requests are published on the prefill side ahead of time, then
the decode side pulls them with ``--concurrency`` pulls in flight (requests/s is taken over the
pulls alone), three ways, one after the other in one run:

1. ``concurrent``: one ``Pull`` call per pull;
2. ``batched``: the same number of pulls again, the worker sending them ``--batch`` at a time in
   one ``PullBatch`` call (as a worker that starts a step's loads together would), so
   ``concurrency / batch`` calls are in flight;
3. ``serial``: ``--serial`` more pulls, one at a time, and as many again naming the publisher's
   block ids (``serial_ahead``: as the vLLM connector pulls, so the decode sidecar READs while its
   GetPublished runs, see kvxfer.server.pull_steps), and as many again expected first
   (``serial_granted``: the decode sidecar holds them and holds the publishers' grants, so it
   READs without any lookup, as for a vLLM request that waited in the decode queue), and as many
   again expected and then prepared (``serial_prepared``: the pull is handed to the decode sidecar
   with ``Prepare`` 1 ms before the worker's Pull, as the vLLM scheduler does when it allocates the
   blocks, so the sidecar has checked and planned it when the Pull comes);
4. ``open_loop`` (with ``--open-loop-rate R``; ``--open-loop-paths plain,named,granted,prepared``
   adds ``open_loop_named``, whose pulls name the publisher's ids, ``open_loop_granted``, whose
   requests are also expected 20 ms before their pull, so the pull reads on a grant with no
   lookup, and ``open_loop_prepared``, whose pulls are also prepared 1 ms ahead; the Expect and
   Prepare calls and the holds they cause run inside the phase and count in its CPU. The open
   loop's Expects are quiet, as the vLLM scheduler sends them: not waited for, answered only when
   they fail, counted in ``expects_failed``):
   pulls arriving as a Poisson process at ``R`` per second for ``--open-loop-seconds``, each
   started when it arrives whatever is in flight. Each phase also reports the garbage collector's
   pauses during it (``gc_pauses``: the sidecars' from their ``kvxfer_gc_pause_seconds``, the
   driver's own; the driver freezes its start-up heap as ``kvxfer serve`` does) and, on the
   prepared path, the Prepares the sidecar declined (``not_prepared``). A closed loop of N in
   flight measures mostly its own queue (Little's law); an open loop at a rate the sidecars sustain
   measures what a pull costs at that load.

``--hop`` picks how the decode worker reaches its sidecar: ``fast`` (the default, as
``kvxfer.client``'s async client does: the fast socket ``<socket>.fast``, else gRPC), ``grpc``
(gRPC only: the hop before the fast socket), ``blocking`` (the blocking ``kvxfer.client.Client``
called from a thread of its own, over that thread's own fast-socket connection, timed in that
thread: what a synchronous worker gets; serial phases only), a comma-separated list of these, or
``both`` (``grpc,fast``): the serial and open-loop phases run once per hop, one hop after the other
within each phase kind, and a side-by-side table follows (``by_hop`` in the JSON). The concurrent
and batched phases use the last async hop.

Every pulled byte is compared with its source. What is measured, per pull (``wait=True``):

* ``latency``: the decode worker's wall time for its Pull (or PullBatch) call;
* ``data``: the data movement itself, as the decode sidecar measured it: from handing the
  descriptors to the data plane (NIXL prepares and posts the READ) to the READ's completion;
* ``overhead`` = latency - data: everything else - both gRPC hops (worker -> decode sidecar, and
  decode -> prefill sidecar's GetPublished), validation, planning, descriptor building, completion
  bookkeeping - *and any time the pull waited behind the other pulls in flight*. It is split into
  ``local_hop`` (latency - the sidecar's own duration), ``peer_fetch`` (the GetPublished round trip
  as the decode sidecar timed it) and ``sidecar_compute`` (the rest inside the decode sidecar).

With ``--concurrency`` pulls in flight the processes are CPU bound, so by Little's law each pull
spends about concurrency / throughput in the system; that queueing is part of ``overhead`` in the
concurrent phase. The serial phase has no queueing: its overhead is the control plane's cost of a
pull. CPU time per pull of each process (concurrent phase) is the cost that bounds throughput.

    python bench/load.py [--pulls 4000] [--concurrency 200] [--batch 20] [--serial 300]
        [--hop fast,grpc,blocking|both] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.client import AsyncClient, Client, KvxferRpcError, PullItem, PullResult
from kvxfer.harness.cluster import BlockAllocator, ClusterError, LocalCluster, parse_sidecar_env
from kvxfer.harness.worker_sim import fill_blocks, verify_blocks
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import SharedKVBuffer
from kvxfer.metrics import GC_PAUSE_NAME, GcPauses
from kvxfer.server.heap import freeze_startup_heap
from kvxfer.topology import RankInfo

#: How the decode worker may reach its sidecar (--hop).
HOPS = ("fast", "grpc", "blocking")


class _Timed(NamedTuple):
    """A pull's result and its latency as timed where the call ran."""

    result: PullResult
    latency: float


class _BlockingHop:
    """The blocking client from a thread of its own (its calls go over that thread's own fast-socket
    connection); each pull is timed in that thread, so that handing the call to it is not counted."""

    def __init__(self, target: str) -> None:
        self.client = Client(target, timeout=60.0)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-blocking")

    async def pull(self, rid: str, peers: list[str], blocks: Any, remote_blocks: Any = None) -> _Timed:
        def timed() -> _Timed:
            t = time.perf_counter()
            res = self.client.pull(rid, peers, blocks, remote_blocks=remote_blocks)
            return _Timed(res, time.perf_counter() - t)

        return await asyncio.get_running_loop().run_in_executor(self._thread, timed)

    async def expect(self, rid: str, peers: list[str]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.client.expect, rid, peers)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.client.close)
        self._thread.shutdown()


#: The sidecars hold expected requests every min(--lease-seconds / 3, 5) s: wait one round and a bit.
HOLD_WAIT_S = 5.5


#: The open-loop phases' keys in the report, by ``--open-loop-paths`` entry.
OPEN_LOOP_KEYS = {"plain": "open_loop", "named": "open_loop_named", "granted": "open_loop_granted",
                  "prepared": "open_loop_prepared"}  # fmt: skip
#: granted: how long before its pull a request is expected (vLLM: it waits in the decode queue
#: while its prefill runs); held at once, its pull reads on the grant. --expect-lead-ms sets it: a
#: request vLLM places at once is pulled a millisecond or so after it was expected, while its Hold is out.
EXPECT_LEAD_S = 0.02
#: kvxfer_pulls_by_path_total's paths, as the open-loop phases report them.
PULL_PATHS_NAME = "kvxfer_pulls_by_path"
#: serial_prepared: from the Prepare's answer to the worker's Pull (vLLM: from allocating the blocks
#: to the workers' start_load_kv, the rest of the engine step).
PREPARE_LEAD_S = 0.001
#: The serial phases, one after the other: (key, request id tag, name the publisher's ids, expect, prepare).
SERIAL_KINDS = (
    ("serial", "s", False, False, False),
    ("serial_ahead", "sa", True, False, False),
    ("serial_granted", "sg", True, True, False),
    ("serial_prepared", "sp", True, True, True),
)


async def run(
    pulls: int, concurrency: int, serial: int, blocks_per_pull: int, layers: int, seed: int, batch: int,
    open_rate: float = 0.0, open_seconds: float = 10.0, hops: tuple[str, ...] = ("fast",),
    open_paths: tuple[str, ...] = ("plain",), sidecar_env: dict[str, str] | None = None,
    expect_lead: float = EXPECT_LEAD_S,
) -> dict[str, Any]:  # fmt: skip
    """Start the sidecars, publish, pull concurrently and serially; return the figures.

    ``hops``: how the decode worker reaches its sidecar (``fast``: the fast socket, ``grpc``: gRPC
    only). The serial and open-loop phases run once per hop, alternating; the concurrent and
    batched phases, and the top-level figures, use the last one.
    """
    lay = KVCacheLayout.attention(
        num_layers=layers, num_blocks=max(4096, 2 * concurrency * blocks_per_pull), block_size=16, num_kv_heads=8,
        head_size=128,
    )  # fmt: skip
    rank = RankInfo(0, 1)
    rng = np.random.default_rng(seed)
    os.environ.setdefault("UCX_MODULES", "^efa")  # see tests/sidecar/conftest.py
    driver_gc = GcPauses()
    with LocalCluster(extra_flags=["--lease-seconds", "600"]) as cluster:
        p = cluster.start_sidecar("prefill", "prefill", "prefill", env=sidecar_env)
        d = cluster.start_sidecar("decode", "decode", "decode", env=sidecar_env)
        cluster.wait_sidecars()  # a sidecar that exits (a setting it refuses) fails here, with its log
        pbuf, dbuf = SharedKVBuffer.create(lay), SharedKVBuffer.create(lay)
        pc = AsyncClient(p.local_socket, fast="grpc" not in hops or "fast" in hops)
        dcs: dict[str, Any] = {
            hop: _BlockingHop(d.local_socket) if hop == "blocking" else AsyncClient(d.local_socket, fast=hop == "fast")
            for hop in hops
        }  # fmt: skip
        async_hops = [hop for hop in hops if hop != "blocking"]
        dc: AsyncClient = dcs[async_hops[-1]] if async_hops else AsyncClient(d.local_socket)
        try:
            await pc.wait_ready(90)
            for c in {dc, *(c for c in dcs.values() if isinstance(c, AsyncClient))}:
                await c.wait_ready(90)
            await pc.register_caches({"kv": (lay, pbuf.ref())}, rank=rank)
            await dc.register_caches({"kv": (lay, dbuf.ref())}, rank=rank)
            # Every request reads the same source blocks (filled once) into its own destination blocks.
            src = np.arange(blocks_per_pull)
            fill_blocks(pbuf, rank, src, salt=7)
            assert verify_blocks(pbuf, rank, src, salt=7)[1] == 0
            d_alloc = BlockAllocator(lay.num_blocks, rng, max_run=blocks_per_pull)
            bufs = (pbuf, dbuf)
            for hop, c in dcs.items():  # handshake, UCX warm-up, the fast socket's connection
                await _pull_phase(pc, c, p.peer_address, src, d_alloc, 20, 4, f"warm-{hop}", bufs)
            # The driver is a long-running worker process too: its start-up heap (torch, numpy, grpc)
            # leaves its collector as the sidecars' does, and its own pauses are reported beside theirs
            # (a pause of the driver holds up every answer it has not read yet).
            freeze_startup_heap()
            driver_gc.start()
            procs = {"prefill": p.proc.pid, "decode": d.proc.pid, "driver": os.getpid()}
            scrapes: dict[str, int | GcPauses] = {"prefill": p.metrics_port, "decode": d.metrics_port,
                                                  "driver": driver_gc}  # fmt: skip
            conc, conc_s, cpu = await _pull_phase(pc, dc, p.peer_address, src, d_alloc, pulls, concurrency, "c", bufs,
                                                  procs)  # fmt: skip
            # The same load again, the worker sending its pulls ``batch`` at a time (PullBatch).
            many, many_s, many_cpu = await _pull_phase(pc, dc, p.peer_address, src, d_alloc, pulls, concurrency, "b",
                                                       bufs, procs, batch)  # fmt: skip
            # One phase kind at a time, every hop in turn, so that both see the same machine.
            by_hop: dict[str, dict[str, Any]] = {hop: {} for hop in hops}
            for kind, tag, named, expect, prepare in SERIAL_KINDS:
                scheduler = dc if prepare else None  # the vLLM scheduler's client sends the Prepare
                for hop, c in dcs.items():
                    by_hop[hop][kind], _, _ = await _pull_phase(pc, c, p.peer_address, src, d_alloc, serial, 1,
                                                                f"{tag}-{hop}", bufs, name_remote=named,
                                                                expect=expect, prepare=scheduler)  # fmt: skip
            if open_rate > 0:
                for path in open_paths:
                    for hop in async_hops or ["fast"]:
                        c = dcs.get(hop, dc)
                        by_hop.setdefault(hop, {})[OPEN_LOOP_KEYS[path]] = await _open_loop(
                            pc, c, p.peer_address, src, d_alloc, open_rate, open_seconds, bufs, rng, procs, scrapes,
                            f"o{path[:2]}-{hop}", name_remote=path in ("named", "granted", "prepared"),
                            expect_lead=expect_lead if path in ("granted", "prepared") else None,
                            prepare=path == "prepared")  # fmt: skip
        finally:
            driver_gc.stop()
            await pc.close()
            for c in {*dcs.values(), dc}:
                await c.close()
            pbuf.close()
            dbuf.close()
    last = by_hop[hops[-1]]
    last_async = by_hop.get(async_hops[-1] if async_hops else "fast", last)
    every = [r for h in by_hop.values() for k, *_ in SERIAL_KINDS for r in h[k]]
    every += [r for h in by_hop.values() for k in OPEN_LOOP_KEYS.values() for r in h.get(k, {}).get("rows", [])]
    return {
        "pulls": pulls,
        "concurrency": concurrency,
        "bytes_per_pull": blocks_per_pull * lay.page_bytes * layers,
        "batch": batch,
        "requests_per_s": pulls / conc_s,
        "batched_requests_per_s": pulls / many_s,
        "concurrent": _stats(conc),
        "batched": _stats(many),
        **{k: _stats(last[k]) for k, *_ in SERIAL_KINDS},
        "cpu_ms_per_pull": {k: v * 1e3 / pulls for k, v in cpu.items()},
        "batched_cpu_ms_per_pull": {k: v * 1e3 / pulls for k, v in many_cpu.items()},
        **{key: _summary(last_async[key]) for key in OPEN_LOOP_KEYS.values() if key in last_async},
        "hop": hops[-1],
        "sidecar_env": dict(sidecar_env or {}),
        "by_hop": {hop: {k: _summary(v) for k, v in h.items()} for hop, h in by_hop.items()},
        "verified_pulls": 2 * pulls + len(every),
        "mismatched_bytes": int(sum(r["bad"] for r in conc + many + every)),
    }


async def _pull_phase(
    pc: AsyncClient, dc: AsyncClient, peer: str, src: Any, alloc: BlockAllocator, n: int, concurrency: int,
    tag: str, bufs: tuple[SharedKVBuffer, SharedKVBuffer], procs: dict[str, int] | None = None, batch: int = 1,
    name_remote: bool = False, expect: bool = False, prepare: AsyncClient | None = None,
) -> tuple[list[dict[str, float]], float, dict[str, float]]:  # fmt: skip
    """Publish ``n`` requests, then pull them ``concurrency`` at a time: (rows, pull-phase seconds, CPU seconds).

    ``prepare``: each pull is first handed to the decode sidecar with ``Prepare`` through this client
    (the vLLM scheduler's), :data:`PREPARE_LEAD_S` before the timed Pull.
    """
    # Publish everything first (leases of 600 s): what is measured is the pulls alone.
    sem = asyncio.Semaphore(64)

    async def publish(i: int) -> None:
        async with sem:
            await pc.publish(f"{tag}{i}", {"kv": src})

    await asyncio.gather(*(publish(i) for i in range(n)))
    if expect:
        for i in range(n):
            await dc.expect(f"{tag}{i}", [peer])
        await asyncio.sleep(HOLD_WAIT_S)  # until a round of holds has covered them all
    dst_pages, want = _views(bufs, src)
    out: list[dict[str, float]] = []

    async def pull(first: int) -> None:
        # One unit in flight: a Pull call, or with ``batch`` > 1 one PullBatch call of ``batch`` pulls
        # (so ``concurrency`` pulls are in flight as concurrency / batch calls).
        async with gate:
            ids = range(first, min(first + batch, n))
            dsts = [alloc.allocate(len(src)) for _ in ids]
            try:
                for dst in dsts:
                    _poison(dst_pages, dst)
                if prepare is not None:
                    planned = await prepare.prepare(f"{tag}{first}", [peer], {"kv": dsts[0]}, remote_blocks={"kv": src})
                    if not planned:
                        raise RuntimeError(f"{tag}{first}: the decode sidecar did not plan the pull ahead")
                    await asyncio.sleep(PREPARE_LEAD_S)
                t = time.perf_counter()
                if batch > 1:
                    items = [PullItem(f"{tag}{i}", [peer], {"kv": d}) for i, d in zip(ids, dsts, strict=True)]
                    results: list[Any] = await dc.pull_batch(items)
                else:
                    remote = {"kv": src} if name_remote else None
                    results = [await dc.pull(f"{tag}{first}", [peer], {"kv": dsts[0]}, remote_blocks=remote)]
                lat = time.perf_counter() - t
                if isinstance(results[0], _Timed):  # timed in the thread that made the call
                    results, lat = [results[0].result], results[0].latency
                for res, dst in zip(results, dsts, strict=True):
                    if isinstance(res, Exception):
                        raise res
                    # Byte-exact against the source pages (checked once against the expected
                    # contents): a cheap comparison, so verifying does not hold up other answers.
                    bad = _mismatched(dst_pages, dst, want)
                    out.append({"latency": lat, "data": res.data_seconds, "sidecar": res.duration_seconds,
                                "fetch": res.fetch_seconds, "bad": bad})  # fmt: skip
            finally:
                for dst in dsts:
                    alloc.release(dst)

    batch = max(batch, 1)
    gate = asyncio.Semaphore(max(concurrency // batch, 1))
    units = [pull(i) for i in range(0, n, batch)]
    cpu0 = {k: _cpu(pid) for k, pid in (procs or {}).items()}
    t0 = time.perf_counter()
    await asyncio.gather(*units)
    seconds = time.perf_counter() - t0
    return out, seconds, {k: _cpu(pid) - cpu0[k] for k, pid in (procs or {}).items()}


async def _open_loop(
    pc: AsyncClient, dc: AsyncClient, peer: str, src: Any, alloc: BlockAllocator, rate: float, seconds: float,
    bufs: tuple[SharedKVBuffer, SharedKVBuffer], rng: np.random.Generator, procs: dict[str, int],
    scrapes: dict[str, int | GcPauses], tag: str = "o",
    name_remote: bool = False, expect_lead: float | None = None, prepare: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Pulls arriving as a Poisson process at ``rate``/s for ``seconds``, each started on arrival.

    ``name_remote``: each pull names the publisher's block ids, as the vLLM connector's pulls do.
    ``expect_lead``: each request is expected on arrival and pulled that many seconds later.
    ``prepare``: its blocks allocated, each pull is handed to the decode sidecar with ``Prepare``
    :data:`PREPARE_LEAD_S` before the timed Pull (the vLLM scheduler's call as it allocates them).
    """
    n = max(int(rate * seconds), 1)
    sem = asyncio.Semaphore(64)

    async def publish(i: int) -> None:
        async with sem:
            await pc.publish(f"{tag}{i}", {"kv": src})

    await asyncio.gather(*(publish(i) for i in range(n)))
    dst_pages, want = _views(bufs, src)
    rows: list[dict[str, float]] = []
    failed: Counter[str] = Counter()  # status code -> pulls that failed with it (an overloaded hop), not in the figures
    in_flight = peak = unprepared = 0

    async def pull(i: int) -> None:
        nonlocal in_flight, peak, unprepared
        if expect_lead is not None:
            try:
                # As the vLLM scheduler sends it: not waited for, answered only if it fails (counted
                # below; such a pull reads after a lookup instead of on a grant).
                await dc.expect_quietly(f"{tag}{i}", [peer])
            except KvxferRpcError as exc:  # over gRPC, awaited: an overloaded hop, counted like a failed pull
                failed[f"EXPECT_{exc.code.name}"] += 1
                return
            await asyncio.sleep(expect_lead)
        try:
            dst = alloc.allocate(len(src))
        except ClusterError:  # so many pulls in flight that the decode cache is full: the sidecars fell behind
            failed["NO_FREE_BLOCKS"] += 1
            # As a decode server drops a request it cannot place: the publish (and the expectation that
            # keeps it held) freed now, not left to expire while the overload lasts.
            with contextlib.suppress(KvxferRpcError):
                await dc.drop_remote(f"{tag}{i}", [peer], reason="no free blocks")
            return
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            _poison(dst_pages, dst)
            if prepare:
                try:
                    if not await dc.prepare(f"{tag}{i}", [peer], {"kv": dst}, remote_blocks={"kv": src}):
                        unprepared += 1  # the sidecar declined to plan it: the Pull plans, as unprepared
                except KvxferRpcError as exc:
                    failed[f"PREPARE_{exc.code.name}"] += 1
                    return
                await asyncio.sleep(PREPARE_LEAD_S)
            t = time.perf_counter()
            try:
                res = await dc.pull(
                    f"{tag}{i}", [peer], {"kv": dst}, remote_blocks={"kv": src} if name_remote else None
                )
            except KvxferRpcError as exc:
                failed[exc.code.name] += 1
                return
            lat = time.perf_counter() - t
            bad = _mismatched(dst_pages, dst, want)
            rows.append({"latency": lat, "data": res.data_seconds, "sidecar": res.duration_seconds,
                         "fetch": res.fetch_seconds, "bad": bad})  # fmt: skip
        finally:
            in_flight -= 1
            alloc.release(dst)

    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    tasks = []
    gc0 = {k: await asyncio.to_thread(_gc_buckets, port) for k, port in scrapes.items()}
    paths0 = await asyncio.to_thread(_pull_paths, scrapes["decode"])
    cpu0 = {k: _cpu(pid) for k, pid in procs.items()}
    t0 = time.perf_counter()
    late = 0  # arrivals the driver started more than 1 ms after their time (it could not keep up)
    quiet0 = dc.quiet_failures
    for i, at in enumerate(arrivals):
        delay = t0 + float(at) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -1e-3:
            late += 1
        tasks.append(asyncio.ensure_future(pull(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return {
        "rate_per_s": rate, "pulls": n, "achieved_per_s": n / elapsed, "max_in_flight": peak,
        "late_arrivals": late, "failed": sum(failed.values()), "failed_by_code": dict(failed), **_stats(rows),
        "not_prepared": unprepared, "expects_failed": dc.quiet_failures - quiet0,
        "cpu_ms_per_pull": {k: (_cpu(pid) - cpu0[k]) * 1e3 / n for k, pid in procs.items()}, "rows": rows,
        "gc_pauses": {k: _gc_pauses(gc0[k], await asyncio.to_thread(_gc_buckets, port)) for k, port in scrapes.items()},
        "pull_paths": {k: v - paths0.get(k, 0.0) for k, v in (await asyncio.to_thread(_pull_paths,
                                                                                      scrapes["decode"])).items()},
    }  # fmt: skip


def _gc_buckets(source: int | GcPauses) -> dict[str, float]:
    """kvxfer_gc_pause_seconds as it stands: cumulative count per bucket bound, and the sum.

    ``source``: a sidecar's metrics port, or this process's own timer. The generations are added
    up: a pause holds up every pull in flight, whichever generation it was.
    """
    families = list(source.collect()) if isinstance(source, GcPauses) else _families(source)
    samples = [(s.name, s.labels.get("le"), s.value) for f in families if f.name == GC_PAUSE_NAME for s in f.samples]
    out: dict[str, float] = {}
    for name, le, value in samples:
        key = le if name.endswith("_bucket") and le is not None else "sum" if name.endswith("_sum") else None
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def _pull_paths(port: int) -> dict[str, float]:
    """kvxfer_pulls_by_path_total of a sidecar (its metrics port) as it stands, by path; empty when not exported."""
    return {s.labels["path"]: s.value for f in _families(port) if f.name == PULL_PATHS_NAME for s in f.samples
            if s.name.endswith("_total")}  # fmt: skip


def _families(port: int) -> list[Any]:
    """A sidecar's metric families, scraped from its metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return list(text_string_to_metric_families(resp.read().decode()))


def _gc_pauses(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The pauses between two scrapes: how many, their seconds in all, and the bound the longest stayed under.

    Empty for a sidecar that does not export them (one older than kvxfer_gc_pause_seconds).
    """
    if not after:
        return {}
    count = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    bounds = sorted(float(k) for k in after if k not in ("sum", "+Inf"))
    longest = next((b for b in bounds if after[repr(b)] - before.get(repr(b), 0.0) == count), math.inf)
    return {"count": count, "seconds": after.get("sum", 0.0) - before.get("sum", 0.0),
            "longest_at_most_s": longest if count else 0.0}  # fmt: skip


def _summary(phase: list[dict[str, float]] | dict[str, Any]) -> dict[str, Any]:
    """A serial phase's rows as statistics; an open-loop phase's figures without its rows."""
    if isinstance(phase, list):
        return _stats(phase)
    return {k: v for k, v in phase.items() if k != "rows"}


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _views(bufs: tuple[SharedKVBuffer, SharedKVBuffer], src: Any) -> tuple[list[Any], list[Any]]:
    """The decode buffer's page views per layer, and the source pages every pull must land (copied once).

    The driver shares the cores with the sidecars it measures: building a view per layer per pull
    and reading the source again each time cost it ~0.65 ms per pull, CPU the sidecars then lacked.
    """
    pbuf, dbuf = bufs
    layers = range(pbuf.layout.num_layers)
    return [dbuf.pages(k) for k in layers], [pbuf.pages(k)[src].copy() for k in layers]


def _pages_of(dst: Any) -> Any:
    """``dst`` as an index into a page array: a slice when the ids are consecutive (a view, not a copy).

    The driver shares its loop with every pull's answer: indexing by a slice spares it a copy per layer
    and per pull when it poisons and checks the blocks.
    """
    first, n = int(dst[0]), len(dst)
    if n == 1 or (int(dst[-1]) - first == n - 1 and bool((np.diff(dst) == 1).all())):
        return slice(first, first + n)
    return dst


def _poison(dst_pages: list[Any], dst: Any) -> None:
    """Flip every byte of the blocks ``dst``: a pull that moved nothing cannot pass the check."""
    at = _pages_of(dst)
    for pages in dst_pages:
        pages[at] ^= 0xFF


def _mismatched(dst_pages: list[Any], dst: Any, want: list[Any]) -> int:
    """Bytes of the pulled pages ``dst`` that differ from the source's."""
    at = _pages_of(dst)
    return sum(int(np.count_nonzero(pages[at] != w)) for pages, w in zip(dst_pages, want, strict=True))


def _stats(rows: list[dict[str, float]]) -> dict[str, float]:
    ms = {k: np.array([r[k] for r in rows]) * 1e3 for k in ("latency", "data", "sidecar", "fetch")}
    parts = {
        "overhead": ms["latency"] - ms["data"],  # everything but the READ itself, queueing included
        "local_hop": ms["latency"] - ms["sidecar"],  # worker <-> its sidecar: the Pull call's gRPC round trip
        "peer_fetch": ms["fetch"],  # handshake (cached) + GetPublished round trip to the prefill sidecar
        "sidecar_compute": ms["sidecar"] - ms["data"] - ms["fetch"],  # validation, planning, descriptors, post
        "sidecar_overhead": ms["sidecar"] - ms["data"],
    }
    out = {
        "measured": len(rows),  # pulls in these figures
        "latency_p50_ms": float(np.percentile(ms["latency"], 50)),
        "latency_p99_ms": float(np.percentile(ms["latency"], 99)),
        "data_p50_ms": float(np.percentile(ms["data"], 50)),
        "data_p99_ms": float(np.percentile(ms["data"], 99)),
    }
    for name, v in parts.items():
        out[f"{name}_p50_ms"] = float(np.percentile(v, 50))
        out[f"{name}_p99_ms"] = float(np.percentile(v, 99))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pulls", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--serial", type=int, default=300, help="pulls run one at a time afterwards")
    ap.add_argument("--blocks", type=int, default=1, help="blocks per pull (small pulls: 1)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=20, help="pulls per PullBatch call in the batched phase")
    ap.add_argument("--open-loop-rate", type=float, default=0.0,
                    help="also pull with Poisson arrivals at this many pulls/s (0: no open-loop phase)")  # fmt: skip
    ap.add_argument("--open-loop-seconds", type=float, default=10.0, help="length of the open-loop phase")
    ap.add_argument("--open-loop-paths", default="plain",
                    help="comma-separated open-loop phases, one after the other: plain (the pull finds the publish "
                         "with GetPublished), named (each pull names the publisher's block ids, as the vLLM "
                         "connector's do: the READ starts at once, the lookup confirms it off the critical "
                         "path), granted (each request is also expected 20 ms before its pull and read on its "
                         "grant, no lookup), prepared (granted, and each pull is also handed to the sidecar with "
                         "Prepare 1 ms before it)")  # fmt: skip
    ap.add_argument("--expect-lead-ms", type=float, default=EXPECT_LEAD_S * 1e3,
                    help="granted and prepared open-loop phases: how long before its pull each request is expected "
                         "(20: it waited in vLLM's queue, its grant has come; 1: vLLM placed it at once, the pull "
                         "overtakes its first Hold's answer)")  # fmt: skip
    ap.add_argument("--hop", default="fast",
                    help="worker -> sidecar, comma-separated to run side by side (serial and open-loop phases): "
                         "fast (the async client over the fast socket, falling back to gRPC), grpc (gRPC only), "
                         "blocking (the blocking client from a thread of its own; serial phases only); both: "
                         "grpc,fast")  # fmt: skip
    ap.add_argument("--sidecar-env", default="", metavar="KVXFER_K=V[,...]",
                    help="settings for both sidecars, e.g. KVXFER_BUSY_POLL_SECONDS=0.1 (the cluster passes on no "
                         "KVXFER_* variable of this process)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        sidecar_env = parse_sidecar_env(a.sidecar_env)
    except ValueError as exc:
        ap.error(f"--sidecar-env: {exc}")
    for flag, value in (("--open-loop-rate", a.open_loop_rate), ("--open-loop-seconds", a.open_loop_seconds),
                        ("--expect-lead-ms", a.expect_lead_ms)):  # fmt: skip
        if not np.isfinite(value) or value < 0:
            ap.error(f"{flag}: must be a finite number >= 0, got {value}")
    import uvloop

    paths = tuple(x for x in a.open_loop_paths.split(",") if x)
    bad = [x for x in paths if x not in OPEN_LOOP_KEYS]
    if bad or not paths:
        known = ", ".join(OPEN_LOOP_KEYS)
        ap.error(f"--open-loop-paths: {bad[0] if bad else a.open_loop_paths!r} is not one of {known}")
    hops = ("grpc", "fast") if a.hop == "both" else tuple(x for x in a.hop.split(",") if x)
    wrong = [x for x in hops if x not in HOPS]
    if wrong or not hops or len(set(hops)) != len(hops):
        ap.error(f"--hop: {a.hop!r}: name each of {', '.join(HOPS)} at most once, comma-separated (or both)")
    r = uvloop.run(run(a.pulls, a.concurrency, a.serial, a.blocks, a.layers, a.seed, a.batch, a.open_loop_rate,
                       a.open_loop_seconds, hops, paths, sidecar_env, a.expect_lead_ms / 1e3))  # fmt: skip
    if a.json:
        print(json.dumps(r))
    else:
        n, conc = r["pulls"], r["concurrency"]
        print(f"{n} pulls of {r['bytes_per_pull']} B, {conc} in flight")
        phases = (
            (f"{conc} in flight, one Pull call each", r["concurrent"], r["requests_per_s"], r["cpu_ms_per_pull"], None,
             None),
            (f"{conc} in flight, PullBatch of {r['batch']}", r["batched"], r["batched_requests_per_s"],
             r["batched_cpu_ms_per_pull"], None, None),
            (f"one at a time ({a.serial})", r["serial"], None, None, None, None),
            (f"one at a time, naming the publisher's ids ({a.serial})", r["serial_ahead"], None, None, None, None),
            (f"one at a time, held while queued: read on grants ({a.serial})", r["serial_granted"], None, None, None,
             None),
            (f"one at a time, on grants, prepared {PREPARE_LEAD_S * 1e3:g} ms ahead ({a.serial})", r["serial_prepared"],
             None, None, None, None),
        )  # fmt: skip
        for path, key in OPEN_LOOP_KEYS.items():
            if key not in r:
                continue
            ol = r[key]
            quiet = f", {ol['expects_failed']} quiet Expects failed" if ol["expects_failed"] else ""
            phases += ((f"open loop ({path}), Poisson arrivals at {ol['rate_per_s']:.0f}/s for {ol['pulls']} pulls "
                        f"(achieved {ol['achieved_per_s']:.0f}/s, at most {ol['max_in_flight']} in flight, "
                        f"{ol['late_arrivals']} arrivals started late, {ol['failed']} failed "
                        f"{ol['failed_by_code'] or ''}{quiet})", ol, None, ol["cpu_ms_per_pull"],
                        ol["gc_pauses"], ol["pull_paths"]),)  # fmt: skip
        for label, st, rate, cpu, gcs, by_path in phases:
            head = f"  {label}: latency p50 {st['latency_p50_ms']:.2f} / p99 {st['latency_p99_ms']:.2f} ms"
            if rate is not None:
                head += f", {rate:.0f} pulls/s (Little's law: {conc / rate * 1e3:.1f} ms in the system per pull)"
            print(head + f", data p50 {st['data_p50_ms']:.3f} ms")
            for part in ("overhead", "local_hop", "peer_fetch", "sidecar_compute"):
                print(f"    {part:16s} p50 {st[part + '_p50_ms']:8.3f} ms   p99 {st[part + '_p99_ms']:8.3f} ms")
            if cpu is not None:
                print("    CPU per pull: " + ", ".join(f"{k} {v:.2f} ms" for k, v in cpu.items())
                      + f"; sidecars together {cpu['prefill'] + cpu['decode']:.2f} ms")  # fmt: skip
            if gcs is not None:
                print("    GC pauses: " + ", ".join(
                    f"{k} {g['count']:.0f} ({g['seconds'] * 1e3:.1f} ms in all, longest <= "
                    f"{g['longest_at_most_s'] * 1e3:g} ms)" if g else f"{k} not exported" for k, g in gcs.items()
                ))  # fmt: skip
            if by_path is not None:
                print("    decode pulls by path: " + (", ".join(f"{k} {v:.0f}" for k, v in by_path.items())
                                                     or "not exported"))  # fmt: skip
        if len(r["by_hop"]) > 1:
            print("side by side, by worker -> sidecar hop (ms):")
            print(f"  {'phase':16s} {'hop':8s} {'latency p50':>11s} {'p99':>7s} {'overhead p50':>12s} {'p99':>7s} "
                  f"{'local_hop p50':>13s}")  # fmt: skip
            for kind in (*(k for k, *_ in SERIAL_KINDS), *OPEN_LOOP_KEYS.values()):
                for hop, h in r["by_hop"].items():
                    if kind in h:
                        st = h[kind]
                        extra = ""
                        if kind in OPEN_LOOP_KEYS.values():
                            extra = (f"  achieved {st['achieved_per_s']:.0f}/s, at most {st['max_in_flight']} in "
                                     f"flight, {st['failed']} failed {st['failed_by_code'] or ''}")  # fmt: skip
                        print(f"  {kind:16s} {hop:8s} {st['latency_p50_ms']:11.3f} {st['latency_p99_ms']:7.3f} "
                              f"{st['overhead_p50_ms']:12.3f} {st['overhead_p99_ms']:7.3f} "
                              f"{st['local_hop_p50_ms']:13.3f}{extra}")  # fmt: skip
        print(f"verified pulls: {r['verified_pulls']}, mismatched bytes: {r['mismatched_bytes']}")
    return 0 if r["mismatched_bytes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
