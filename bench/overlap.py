#!/usr/bin/env python3
"""How much of a transfer hides behind the prefill: pull, push and layer-wise push, side by side.

Real processes from :class:`kvxfer.harness.cluster.LocalCluster`: a prefill and a decode sidecar and
two synthetic workers (shared memory, or ``--memory cuda`` for GPU tensors shared by CUDA IPC).
The prefill worker is a *synthetic layer-by-layer producer*: the request's KV is written up front
and each layer then "computes" for ``--layer-ms`` (a sleep standing for the layer's kernels), so
the layer's KV counts as complete at the end of its slot. Per request and mode:

* ``pull``: the prefill computes every layer and publishes; the decode worker then pulls (READ);
* ``push``: the decode worker offers its blocks first; the prefill computes and publishes; its
  sidecar WRITEs the whole request;
* ``push-layerwise``: as push, and the prefill announces the step (``StreamStep``) and signals each
  layer (``LayerDone``) as it completes: the sidecar WRITEs the layer while the next computes.

The figure is the time from the last layer computed to the last byte landed on the decode worker
(``CLOCK_MONOTONIC`` of both worker processes on one host), and the bytes every decode pull
verified. Every mode runs in the same cluster, interleaved request by request.

  .venv/bin/python bench/overlap.py                                  # CPU, shared memory
  python3 bench/overlap.py --memory cuda --out $OUT                  # one GPU
  python3 bench/overlap.py --memory cuda --decode-device 1 --out $OUT
  python3 bench/overlap.py --memory cuda --gpu-compute --out $OUT    # layers as GPU work + CUDA events

With ``--gpu-compute`` each layer is GPU work (a spin, then the layer's KV written by a device
copy) that the producer only queues; layer-wise push then relies on the per-layer CUDA events the
sidecar waits for, and the control mode without them must find wrong bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for kvxfer

import numpy as np

MODES = ("pull", "push", "push-layerwise")
#: With --gpu-compute: layer-wise push whose worker sends no CUDA events (a control: the sidecar
#: then WRITEs layers the GPU has not written yet, and the decode side must find wrong bytes).
CONTROL = "push-layerwise-no-events"


def layout(layers: int, num_blocks: int, heads: int, head_size: int) -> Any:
    """Llama-3-8B-shaped by default (32 layers, 8 KV heads, head 128, bf16, block 16, HND)."""
    from kvxfer.layout import KVCacheLayout

    return KVCacheLayout.attention(num_layers=layers, num_blocks=num_blocks, block_size=16, num_kv_heads=heads,
                                   head_size=head_size, dtype="bf16", order="HND")  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode, interleaved, in one cluster; returns the report."""
    from kvxfer.harness.cluster import BlockAllocator, LocalCluster

    lay = layout(args.layers, args.num_blocks, args.kv_heads, args.head_size)
    memory = ("shm", "shm") if args.memory == "shm" else (f"cuda:{args.prefill_device}", f"cuda:{args.decode_device}")
    rng = np.random.default_rng(args.seed)
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    workdir = Path(tempfile.mkdtemp(prefix="kvx-ovl-"))
    t0 = time.perf_counter()
    with LocalCluster(workdir=str(workdir)) as cluster:
        pre = cluster.start_sidecar("prefill-0", "prefill", "prefill")
        dec = cluster.start_sidecar("decode-0", "decode", "decode")
        pw = cluster.start_worker("prefill-w0", pre, {"kv": lay}, (0, 1), memory=memory[0])
        dw = cluster.start_worker("decode-w0", dec, {"kv": lay}, (0, 1), memory=memory[1])
        cluster.wait_workers(timeout=300)
        setup_s = time.perf_counter() - t0
        p_alloc, d_alloc = BlockAllocator(lay.num_blocks, rng, 64), BlockAllocator(lay.num_blocks, rng, 64)
        step = 0
        for i in range(args.warmup + args.requests):
            for mode in args.modes:
                step += 1
                rid, salt = f"ovl-{mode}-{i}", 1000 + step
                p_blocks, d_blocks = p_alloc.allocate(args.blocks), d_alloc.allocate(args.blocks)
                tokens = args.blocks * lay.block_size
                gpu = ("no-events" if mode == CONTROL else "events") if args.gpu_compute else ""
                if mode == "pull":
                    t_last = pw.call("produce", rid, {"kv": p_blocks}, salt, args.layer_ms, False, step, gpu)["t_last"]
                    got = dw.call("pull", rid, [pre.peer_address], {"kv": d_blocks}, salt, "prefill")
                else:
                    layerwise = mode.startswith("push-layerwise")
                    spans = {"kv": tokens} if layerwise else None
                    dw.send("pull", rid, [pre.peer_address], {"kv": d_blocks}, salt, "prefill", None, True, spans)
                    time.sleep(0.05)  # the offer is at the prefill sidecar, as when a proxy sends both at once
                    t_last = pw.call("produce", rid, {"kv": p_blocks}, salt, args.layer_ms, layerwise, step,
                                     gpu)["t_last"]  # fmt: skip
                    got = dw.recv()
                p_alloc.release(p_blocks)
                d_alloc.release(d_blocks)
                if got["mismatched"] and mode != CONTROL:
                    raise RuntimeError(f"{rid}: {got['mismatched']} bytes differ")
                if i >= args.warmup:
                    per_mode[mode].append({"after_last_layer_ms": 1000 * (got["t_done"] - t_last),
                                           "bytes": got["checked"], "mismatched": got["mismatched"]})  # fmt: skip
        codes = cluster.stop()
    summary = {}
    for mode, rows in per_mode.items():
        lat = [r["after_last_layer_ms"] for r in rows]
        summary[mode] = {
            "requests": len(rows), "bytes_per_request": rows[0]["bytes"] if rows else 0,
            "p50_ms": statistics.median(lat) if lat else float("nan"),
            "p90_ms": float(np.percentile(lat, 90)) if lat else float("nan"),
            "min_ms": min(lat) if lat else float("nan"),
            "requests_with_wrong_bytes": sum(1 for r in rows if r["mismatched"]),
        }  # fmt: skip
    return {
        "memory": memory, "layers": args.layers, "blocks": args.blocks, "layer_ms": args.layer_ms,
        "prefill_ms": args.layers * args.layer_ms, "page_bytes": lay.page_bytes, "setup_s": setup_s,
        "summary": summary, "rows": per_mode, "sidecar_exit_codes": codes,
    }  # fmt: skip


def main() -> int:
    """Command line; prints a table and writes ``overlap.json`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", choices=("shm", "cuda"), default="shm")
    ap.add_argument("--prefill-device", type=int, default=0)
    ap.add_argument("--decode-device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=128, help="blocks per request (16 tokens each)")
    ap.add_argument("--layer-ms", type=float, default=2.0, help="each layer's synthetic compute time")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gpu-compute", action="store_true",
                    help="(--memory cuda) each layer is GPU work the producer does not wait for, with a CUDA event "
                    f"per layer; adds the control mode {CONTROL}")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.gpu_compute:
        if args.memory != "cuda":
            ap.error("--gpu-compute: needs --memory cuda")
        args.modes.append(CONTROL)
    bad = [m for m in args.modes if m not in (*MODES, CONTROL)]
    if bad or not args.modes:
        ap.error(f"--modes: unknown {bad or args.modes}; known: {', '.join(MODES)}")
    if 2 * args.blocks + 4 > args.num_blocks:
        ap.error(f"--blocks: {args.blocks} blocks per request need --num-blocks of at least {2 * args.blocks + 4}")
    rep = run(args)
    mib = rep["summary"][args.modes[0]]["bytes_per_request"] / 2**20
    print(f"{rep['layers']} layers x {args.layer_ms:g} ms = {rep['prefill_ms']:g} ms of prefill, {mib:.1f} MiB per "
          f"request, memory {rep['memory']}; last layer computed -> last byte landed:")  # fmt: skip
    for mode, s in rep["summary"].items():
        print(f"  {mode:<26} p50 {s['p50_ms']:8.2f} ms   p90 {s['p90_ms']:8.2f} ms   min {s['min_ms']:8.2f} ms   "
              f"({s['requests']} requests, {s['requests_with_wrong_bytes']} with wrong bytes)")  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "overlap.json").write_text(json.dumps(rep, indent=2))
    sys.stdout.flush()
    os._exit(0)  # native data-plane libraries may crash in exit-time destructors


if __name__ == "__main__":
    sys.exit(main())
