"""The sidecar's heap: collector pauses in its metrics (GcPauses), start-up objects frozen (kvxfer.server.heap)."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import urllib.request

from prometheus_client import CollectorRegistry

from kvxfer.harness.cluster import LocalCluster
from kvxfer.metrics import PAUSE_BUCKETS, GcPauses
from kvxfer.server.heap import freeze_startup_heap
from tests.sidecar.helpers import Harness, attention


def _count(registry: CollectorRegistry, generation: int, le: str | None = None) -> float:
    name, labels = "kvxfer_gc_pause_seconds_count", {"generation": str(generation)}
    if le is not None:
        name, labels = "kvxfer_gc_pause_seconds_bucket", labels | {"le": le}
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


async def test_each_collection_is_counted_once_in_its_generation(harness: Harness) -> None:
    lay = attention()
    _ps, _pw, ds, _dw = await harness.deployment({"kv": lay}, {"kv": lay})
    assert ds[0].metrics is not None
    reg = ds[0].metrics.registry
    before = [_count(reg, g) for g in (0, 1, 2)]
    gc.collect(2)
    gc.collect(0)
    after = [_count(reg, g) for g in (0, 1, 2)]
    # Collections the test's own allocations set off may come on top, but never fewer.
    assert after[2] - before[2] >= 1
    assert after[0] - before[0] >= 1
    # Every pause lies in some bucket: the +Inf bucket is the count, and the buckets only grow.
    bounds = [repr(b) for b in PAUSE_BUCKETS]
    cumulative = [_count(reg, 2, le) for le in (*bounds, "+Inf")]
    assert cumulative == sorted(cumulative)
    assert cumulative[-1] == after[2]
    ds[0].metrics.gc_pauses.stop()
    stopped = _count(reg, 2)
    gc.collect(2)
    assert _count(reg, 2) == stopped  # stopped with the sidecar: no callback is left behind


def test_a_pause_lands_in_its_bucket() -> None:
    """The callback files a pause under the first bucket that holds it (what the collector reports)."""
    reg = CollectorRegistry(auto_describe=True)
    pauses = GcPauses()
    reg.register(pauses)
    for seconds, gen in ((0.003, 1), (0.3, 2)):
        pauses._began = time.perf_counter() - seconds  # a collection that started ``seconds`` ago
        pauses._on_gc("stop", {"generation": gen})
    assert _count(reg, 1, "0.0025") == 0.0
    assert _count(reg, 1, "0.005") == 1.0
    assert _count(reg, 2, "0.25") == 0.0
    assert _count(reg, 2, "+Inf") == 1.0
    assert reg.get_sample_value("kvxfer_gc_pause_seconds_sum", {"generation": "2"}) >= 0.3


def test_freezing_moves_the_live_objects_out_of_the_collector() -> None:
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > before
        assert len(gc.get_objects()) < frozen  # what is left to scan is what came after
    finally:
        gc.unfreeze()


async def test_kvxfer_serve_freezes_its_start_up_heap(harness: Harness) -> None:
    """A served sidecar has frozen what start-up made: its debug log says how many objects, and its metrics serve."""
    with LocalCluster(workdir=str(harness.sock_dir / "cluster"), log_level="debug") as cluster:
        sc = cluster.start_sidecar("d", "decode", "decode")
        cluster.wait_sidecars()
        frozen = []
        for _ in range(100):
            frozen = [json.loads(ln) for ln in sc.log_path.read_text().splitlines() if "start-up heap frozen" in ln]
            if frozen:
                break
            await asyncio.sleep(0.05)
        assert frozen, sc.log_path.read_text()[-2000:]
        # torch, grpc, protobuf and NIXL are loaded by then: tens of thousands of objects at least.
        assert frozen[0]["objects"] > 10_000
        url = f"http://127.0.0.1:{sc.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        # The collect before freezing was timed: one generation-2 pause at least.
        line = next(ln for ln in body.splitlines() if ln.startswith('kvxfer_gc_pause_seconds_count{generation="2"}'))
        assert float(line.split()[-1]) >= 1.0
