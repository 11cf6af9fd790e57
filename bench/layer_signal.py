#!/usr/bin/env python3
"""What a layer-wise push signal costs the forward pass: the worker thread's time per ``save_kv_layer``.

The connector's ``save_kv_layer`` (``WorkerSide.layer_saved``) hands a ``LayerDone`` call to its
client's event-loop thread and returns: no copy, no wait. This measures exactly that hand-off on
the calling thread, against a real sidecar (``kvxfer serve`` with a registered synthetic worker,
the call carried by the fast socket), and how long the sidecar then took to answer all of them.

  .venv/bin/python bench/layer_signal.py [--signals 20000] [--layers 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for kvxfer

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def main() -> int:
    """Command line: prints the per-signal cost on the worker thread (median, p99) and the drain time."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signals", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()

    from kvxfer.client import Client
    from kvxfer.harness.cluster import LocalCluster
    from kvxfer.layout import KVCacheLayout
    from kvxfer.wire import common_pb2, local_pb2

    lay = KVCacheLayout.attention(num_layers=args.layers, num_blocks=64, block_size=16, num_kv_heads=8, head_size=64)
    with LocalCluster(workdir=tempfile.mkdtemp(prefix="kvx-sig-")) as cluster:
        sc = cluster.start_sidecar("prefill-0", "prefill", "prefill")
        cluster.start_worker("prefill-w0", sc, {"kv": lay}, (0, 1))
        cluster.wait_workers()
        client = Client(sc.local_socket)
        req = local_pb2.StreamedRequest(request_id="sig", blocks=[common_pb2.BlockList(group="kv", block_ids=[1])],
                                        start_token=0, end_token=16)  # fmt: skip
        client.call(client.aio.stream_step(1, [req]))
        futures, costs = [], []
        for i in range(args.signals):
            t0 = time.perf_counter()
            futures.append(client.submit(client.aio.layer_done(1, "kv", i % args.layers)))  # what layer_saved does
            costs.append(time.perf_counter() - t0)
        t_sent = time.perf_counter()
        for f in futures:
            f.result(timeout=60)
        drain = time.perf_counter() - t_sent
        client.close()
    costs.sort()
    print(f"{args.signals} layer signals: on the worker thread median {1e6 * statistics.median(costs):.1f} us, "
          f"p99 {1e6 * costs[int(0.99 * len(costs))]:.1f} us, max {1e6 * costs[-1]:.1f} us; the sidecar answered "
          f"the last {drain * 1000:.0f} ms after the last was handed over "
          f"({1e6 * drain / args.signals:.1f} us per signal behind the caller)")  # fmt: skip
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
