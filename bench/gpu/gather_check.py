#!/usr/bin/env python3
"""The same-host gather kernel on a GPU: exact bytes, then its rate beside the copy engines'.

1. Correctness: random spans between two torch buffers on one GPU (sizes 0, 1, 15, 17, unaligned
   offsets, 64 KiB chunk edges, large spans), moved by ``CudaDriver.copy_async(kernel=True)``;
   every destination byte compared with the same spans copied one by one by torch, and the bytes
   between spans checked untouched.
2. Rate: the same span lists moved by the kernel and by the copy engines (one
   ``cuMemcpyBatchAsync``), median wall time from submission to completion, as GB/s and as a
   fraction of torch's device copy of 1 GiB in the same run: 4096 x 64 KiB, a fragmented 1 GiB and
   2 GiB pull of Llama-3-8B (runs of 1..64 blocks, one span per run per layer), and 64 x 32 MiB.

  python3 bench/gpu/gather_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kvxfer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sidecar_vram_bench's device copy rate

import numpy as np
from sidecar_vram_bench import copy_rate

MiB = 1 << 20


def correctness(torch: Any, drv: Any, rng: np.random.Generator) -> dict[str, Any]:
    arena = 1024 * MiB
    src = torch.randint(0, 256, (arena,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(arena, dtype=torch.uint8, device="cuda:0")
    sizes = [0, 1, 15, 16, 17, 4095, 65535, 65536, 65537, 3 * 65536 + 5, 8 * MiB + 3, 16]
    sizes += rng.integers(1, 2 * MiB, 300).tolist()
    sizes += (rng.integers(1, 4096, 200) * 16).tolist()  # aligned, the KV page case
    order = rng.permutation(len(sizes))
    s_off, d_off, at = [0] * len(sizes), [0] * len(sizes), 0
    for i in order:
        at += int(rng.integers(0, 3)) * int(rng.choice([1, 16, 4096]))
        d_off[i] = at
        at += sizes[i]
        s_off[i] = int(rng.integers(0, arena - sizes[i] + 1)) if rng.random() < 0.5 else (
            int(rng.integers(0, (arena - sizes[i]) // 16 + 1)) * 16)  # fmt: skip
    assert at <= arena
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    u64 = np.uint64
    batch = drv.copy_async(0, np.array(d_off, u64) + u64(base_d), np.array(s_off, u64) + u64(base_s),
                           np.array(sizes, u64), kernel=True)  # fmt: skip
    drv.wait(batch)
    want = torch.zeros_like(dst)
    for s, d, z in zip(s_off, d_off, sizes, strict=True):
        want[d : d + z] = src[s : s + z]
    bad = int((want != dst).sum().item())
    return {"how": batch.how, "spans": len(sizes), "bytes": int(sum(sizes)), "mismatched": bad,
            "kernel_error": drv.kernels.error, "ok": batch.how == "kernel" and bad == 0}  # fmt: skip


def llama_spans(rng: np.random.Generator, tokens: int, max_run: int, blocks: int = 4096) -> tuple[Any, Any, Any]:
    """(src offsets, dst offsets, sizes) of a Llama-3-8B pull, one span per run per layer (HND pages of 64 KiB)."""
    from kvxfer.harness.cluster import BlockAllocator

    page, layers, region = 64 * 1024, 32, 64 * 1024 * blocks
    n = -(-tokens // 16)
    p_ids = np.array(BlockAllocator(blocks, rng, max_run).allocate(n))
    d_ids = np.array(BlockAllocator(blocks, rng, max_run).allocate(n))
    # Runs where both sides are contiguous (what the topology coalesces).
    cut = np.flatnonzero((np.diff(p_ids) != 1) | (np.diff(d_ids) != 1)) + 1
    starts = np.concatenate([[0], cut])
    lens = np.diff(np.concatenate([starts, [n]]))
    src, dst, size = [], [], []
    for layer in range(layers):
        src.append(layer * region + p_ids[starts] * page)
        dst.append(layer * region + d_ids[starts] * page)
        size.append(lens * page)
    return np.concatenate(src), np.concatenate(dst), np.concatenate(size)


def rates(torch: Any, drv: Any, rng: np.random.Generator, copy: float, reps: int) -> list[dict[str, Any]]:
    region_bytes = 32 * 64 * 1024 * 4096  # 8 GiB: one Llama-3-8B cache of 4096 blocks
    src = torch.empty(region_bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(region_bytes, dtype=torch.uint8, device="cuda:0")
    u64 = np.uint64
    cases: list[tuple[str, Any, Any, Any]] = []
    k = np.arange(4096, dtype=u64)
    perm = rng.permutation(4096).astype(u64)
    cases.append(("4096 x 64 KiB, scattered", perm * u64(2 * 65536), k * u64(65536), np.full(4096, 65536, u64)))
    for tokens, label in ((1024, "128 MiB"), (8192, "1 GiB"), (16384, "2 GiB")):
        s, d, z = llama_spans(rng, tokens, 64)
        cases.append((f"{label} fragmented (runs 1..64)", s.astype(u64), d.astype(u64), z.astype(u64)))
    s, d, z = llama_spans(rng, 16384, 4096)
    cases.append(("2 GiB contiguous", s.astype(u64), d.astype(u64), z.astype(u64)))
    cases.append(("64 x 32 MiB", np.arange(64, dtype=u64) * u64(64 * MiB), np.arange(64, dtype=u64) * u64(32 * MiB),
                  np.full(64, 32 * MiB, u64)))  # fmt: skip
    out = []
    for name, s, d, z in cases:
        nbytes = int(z.sum())
        row: dict[str, Any] = {"case": name, "spans": int(z.size), "MiB": nbytes / MiB}
        for how in ("kernel", "copy-engine"):
            times, submits = [], []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                b = drv.copy_async(0, d + u64(dst.data_ptr()), s + u64(src.data_ptr()), z, kernel=how == "kernel")
                t1 = time.perf_counter()
                drv.wait(b)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                    submits.append(t1 - t0)
                assert b.how == how, (b.how, drv.kernels.error)
            t = statistics.median(times)
            row[f"{how}_submit_us"] = statistics.median(submits) * 1e6
            row[f"{how}_ms"] = t * 1e3
            row[f"{how}_GBps"] = nbytes / t / 1e9
            row[f"{how}_vs_copy"] = nbytes / t / 1e9 / copy
        row["kernel_speedup"] = row["copy-engine_ms"] / row["kernel_ms"]
        out.append(row)
        print(f"{name:32} {row['spans']:6} spans {row['MiB']:7.0f} MiB  kernel {row['kernel_GBps']:7.1f} GB/s "
              f"({row['kernel_vs_copy']:.3f} of copy, {row['kernel_ms']:.3f} ms)  copy engines "
              f"{row['copy-engine_GBps']:7.1f} GB/s ({row['copy-engine_vs_copy']:.3f}, "
              f"{row['copy-engine_ms']:.3f} ms)  submit {row['kernel_submit_us']:.0f} us  "
              f"x{row['kernel_speedup']:.1f}", flush=True)  # fmt: skip
    return out


def driver_call_us(drv: Any) -> dict[str, float]:
    """Median microseconds of one cheap driver call (cuEventQuery of a finished event), two ways.

    ``pushed``: context pushed and popped around it, every call letting the GIL go (kvxfer before
    run 15); ``poll``: what a READ's poll makes now (the context left current, calls that keep the GIL).
    """
    import ctypes

    one = np.array([0], dtype=np.uint64)
    b = drv.copy_async(0, one, one, one)  # an empty copy: just an event to query
    drv.wait(b)
    ev = ctypes.c_void_p(b.event)
    drv._lib.cuEventQuery.argtypes, drv._lib.cuEventQuery.restype = [ctypes.c_void_p], ctypes.c_int

    def pushed() -> None:
        with drv._current(0):
            drv._lib.cuEventQuery(ev)

    def poll() -> None:
        drv._make_current(0)
        drv._fast.cuEventQuery(ev)

    out = {}
    for name, call in (("pushed", pushed), ("poll", poll)):
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e6
    return out


def idle_gaps(torch: Any, drv: Any, rng: np.random.Generator, reps: int, gap_ms: float) -> list[dict[str, Any]]:
    """A 128 MiB fragmented gather submitted after a gap of ``gap_ms``: none, asleep, or spinning.

    Why a READ's submission costs ~3x more in a sidecar than in a loop: the sidecar's thread sleeps
    between pulls. If the cost comes back after a sleep but not after a spin of the same length, the
    CPU itself (a core that idled: clock, caches) is the cause, not the driver or the process.
    """
    src = torch.empty(32 * 64 * 1024 * 4096, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    s, d, z = (a.astype(np.uint64) for a in llama_spans(rng, 1024, 64))
    s, d = s + np.uint64(src.data_ptr()), d + np.uint64(dst.data_ptr())
    work = np.arange(4096, dtype=np.uint64)
    out = []
    for how in ("none", "sleep", "spin"):
        rows: list[tuple[float, ...]] = []
        for i in range(reps + 2):
            if how == "sleep":
                time.sleep(gap_ms / 1e3)
            elif how == "spin":
                until = time.perf_counter() + gap_ms / 1e3
                while time.perf_counter() < until:
                    pass
            t0 = time.perf_counter()
            int((work * np.uint64(3) + np.uint64(1)).sum())  # pure CPU: a few numpy calls
            t1 = time.perf_counter()
            b = drv.copy_async(0, d, s, z, kernel=True)
            t2 = time.perf_counter()
            drv.wait(b)
            if i >= 2:
                rows.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, *drv.kernels.last_us))
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        row = dict(zip(("gap", "numpy_us", "submit_us", "table_us", "upload_us", "launch_us"),
                       (how, *med), strict=True))  # fmt: skip
        out.append(row)
        print(f"after {how:5} gap of {gap_ms:.0f} ms: numpy {med[0]:.1f} us, submit {med[1]:.1f} us (table "
              f"{med[2]:.1f}, upload {med[3]:.1f}, launch {med[4]:.1f})", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvxfer-gather"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--with-nixl-agent",
        action="store_true",
        help="make a NIXL agent with UCX in this process first, as a sidecar has one",
    )
    ap.add_argument("--gap-ms", type=float, default=0.0, help="also time a submission after idle gaps this long")
    ap.add_argument("--skip-rates", action="store_true", help="no rate table (with --gap-ms: the gaps alone)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"ok": False}
    try:
        import torch

        from kvxfer import cuda_ipc
        from kvxfer.cuda_gather import Nvrtc

        torch.zeros(1, device="cuda:0")  # the primary context, as a worker has it
        drv = cuda_ipc.driver()
        if args.with_nixl_agent:
            from kvxfer.transport import TransportConfig, create_transport

            result["agent"] = create_transport("nixl", "gather-check", TransportConfig()).agent_name
        result["driver_call_us"] = driver_call_us(drv)
        calls = result["driver_call_us"]
        print(f"one driver call (cuEventQuery of a finished event): context pushed, GIL let go {calls['pushed']:.2f} "
              f"us; as a READ's poll now {calls['poll']:.2f} us", flush=True)  # fmt: skip
        nv = Nvrtc.load()
        result["nvrtc"] = {"path": nv.path, "version": nv.version()}
        print(f"NVRTC {nv.version()} at {nv.path}; {torch.cuda.get_device_name(0)}", flush=True)
        rng = np.random.default_rng(args.seed)
        result["correctness"] = correctness(torch, drv, rng)
        print(f"{'PASS' if result['correctness']['ok'] else 'FAIL'} correctness: {result['correctness']}", flush=True)
        copy = copy_rate(1 << 30, 0, 0)
        result["copy_GBps"] = copy
        print(f"device copy 1 GiB: {copy:.0f} GB/s (bytes moved once)", flush=True)
        if args.gap_ms > 0:
            result["idle_gaps"] = idle_gaps(torch, drv, rng, max(args.reps, 20), args.gap_ms)
        if not args.skip_rates:
            result["rates"] = rates(torch, drv, rng, copy, args.reps)
        result["ok"] = bool(result["correctness"]["ok"])
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    (Path(args.out) / "gather_check.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
