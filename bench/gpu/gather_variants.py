#!/usr/bin/env python3
"""Variants of the same-host gather kernel, side by side on one GPU, and what its launch costs.

Issue 14's contiguous target (a 2 GiB pull at >= 0.85 of the device copy) leaves about 0.15 ms for
everything but the copy; the kernel alone ran at ~0.93 (gather_check). This script times, in one
process and one run:

1. **GPU time** (CUDA events around one launch, median of ``--reps``) of kernel variants on the
   spans of real pulls (Llama-3-8B, 64 KiB pages; the same lists as ``gather_check.py``), as a
   fraction of torch's device copy of the same number of bytes, timed the same way. Variants: the
   shipped kernel (``kvxfer.cuda_gather.KERNEL_SOURCE``), and one source with knobs: loads in flight
   per thread, cache-streaming loads and stores, chunk size, blocks per SM, and chunks handed to
   thread blocks in contiguous ranges instead of round robin. Every variant's bytes are checked.
2. **Host time of a launch**: the shipped way (table upload from pinned memory + launch) against the
   table passed in the launch's parameters (``__grid_constant__``, 4 KiB and 32 KiB parameter
   blocks: no upload), back to back and after a 20 ms sleep (the sidecar sleeps between pulls).

  python3 bench/gpu/gather_variants.py --out $OUT
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from gather_check import llama_spans

MiB = 1 << 20
u64 = np.uint64

VARIANT_SOURCE = r"""
typedef unsigned long long u64;
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef STREAMING
#define STREAMING 0
#endif
#ifndef RANGES
#define RANGES 0
#endif
#ifndef PARAM_WORDS
#define PARAM_WORDS 0
#endif

__device__ __forceinline__ uint4 load16(const uint4* p) {
#if STREAMING
  return __ldcs(p);
#else
  return *p;
#endif
}
__device__ __forceinline__ void store16(uint4* p, const uint4 v) {
#if STREAMING
  __stcs(p, v);
#else
  *p = v;
#endif
}

__device__ __forceinline__ void copy_chunk(const char* s, char* d, u64 nbytes) {
  const unsigned int step = blockDim.x;
  if ((((u64)s | (u64)d | nbytes) & 15) == 0) {
    const uint4* s4 = (const uint4*)s;
    uint4* d4 = (uint4*)d;
    const u64 words = nbytes >> 4;
    u64 i = threadIdx.x;
    for (; i + (UNROLL - 1) * step < words; i += UNROLL * step) {
      uint4 v[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) v[k] = load16(s4 + i + k * step);
#pragma unroll
      for (int k = 0; k < UNROLL; ++k) store16(d4 + i + k * step, v[k]);
    }
    for (; i < words; i += step) store16(d4 + i, load16(s4 + i));
  } else {
    for (u64 i = threadIdx.x; i < nbytes; i += step) d[i] = s[i];
  }
}

__device__ __forceinline__ void gather(const u64* table, unsigned int n, u64 chunk) {
  const u64* src = table;
  const u64* dst = table + n;
  const u64* len = table + 2 * (u64)n;
  const u64* first = table + 3 * (u64)n;
  const u64 total = first[n];
#if RANGES
  const u64 per = (total + gridDim.x - 1) / gridDim.x;
  const u64 c0 = blockIdx.x * per;
  const u64 c1 = c0 + per < total ? c0 + per : total;
  if (c0 >= c1) return;
  unsigned int lo = 0, hi = n;
  while (hi - lo > 1) { const unsigned int mid = (lo + hi) >> 1; if (first[mid] <= c0) lo = mid; else hi = mid; }
  for (u64 c = c0; c < c1; ++c) {
    while (first[lo + 1] <= c) ++lo;
#else
  for (u64 c = blockIdx.x; c < total; c += gridDim.x) {
    unsigned int lo = 0, hi = n;
    while (hi - lo > 1) { const unsigned int mid = (lo + hi) >> 1; if (first[mid] <= c) lo = mid; else hi = mid; }
#endif
    const u64 off = (c - first[lo]) * chunk;
    const u64 rest = len[lo] - off;
    copy_chunk((const char*)src[lo] + off, (char*)dst[lo] + off, rest < chunk ? rest : chunk);
  }
}

#if PARAM_WORDS
struct Table { u64 w[PARAM_WORDS]; };
extern "C" __global__ void __launch_bounds__(1024) kvxfer_gather(const __grid_constant__ Table t, unsigned int n,
                                                                 u64 chunk) {
  gather(t.w, n, chunk);
}
#else
extern "C" __global__ void __launch_bounds__(1024) kvxfer_gather(const u64* __restrict__ table, unsigned int n,
                                                                 u64 chunk) {
  gather(table, n, chunk);
}
#endif
"""

# name: (defines, threads, blocks per SM, chunk KiB); "shipped" is kvxfer.cuda_gather's kernel as it is.
VARIANTS: dict[str, tuple[dict[str, int], int, int, int]] = {
    "shipped": ({}, 512, 16, 64),
    "same-as-shipped": ({"UNROLL": 4}, 512, 16, 64),
    "resident-only": ({"UNROLL": 4}, 512, 4, 64),
    "unroll8": ({"UNROLL": 8}, 512, 16, 64),
    "streaming": ({"UNROLL": 4, "STREAMING": 1}, 512, 16, 64),
    "unroll8-streaming": ({"UNROLL": 8, "STREAMING": 1}, 512, 16, 64),
    "chunk256": ({"UNROLL": 4}, 512, 16, 256),
    "ranges": ({"UNROLL": 4, "RANGES": 1}, 512, 4, 64),
    "ranges-unroll8-streaming": ({"UNROLL": 8, "STREAMING": 1, "RANGES": 1}, 512, 4, 64),
    "t1024-unroll4": ({"UNROLL": 4}, 1024, 2, 64),
    "t256-unroll8": ({"UNROLL": 8}, 256, 8, 64),
}


class Driver:
    """The few driver calls this script makes itself (torch's primary context is current)."""

    def __init__(self) -> None:
        from kvxfer import cuda_ipc

        self.lib = cuda_ipc.driver()._lib
        vp = ctypes.c_void_p
        sigs = {
            "cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
            "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
            "cuLaunchKernel": [vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_uint, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)],
            "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, vp, ctypes.c_size_t, vp],
            "cuMemHostAlloc": [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        }  # fmt: skip
        for name, argtypes in sigs.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def attr(self, attr: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, 0), "cuDeviceGetAttribute")
        return int(v.value)

    def function(self, ptx: bytes) -> ctypes.c_void_p:
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, b"kvxfer_gather"), "cuModuleGetFunction")
        return fn

    def pinned(self, nbytes: int) -> tuple[int, Any]:
        host = ctypes.c_void_p()
        self.check(self.lib.cuMemHostAlloc(ctypes.byref(host), nbytes, 0), "cuMemHostAlloc")
        return int(host.value or 0), np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(host.value))


def cases(rng: np.random.Generator) -> list[tuple[str, Any, Any, Any]]:
    out = []
    for tokens, max_run, label in ((128, 4096, "16 MiB contiguous"), (1024, 64, "128 MiB fragmented"),
                                   (8192, 64, "1 GiB fragmented"), (16384, 64, "2 GiB fragmented"),
                                   (16384, 4096, "2 GiB contiguous")):  # fmt: skip
        s, d, z = llama_spans(rng, tokens, max_run)
        out.append((label, s.astype(u64), d.astype(u64), z.astype(u64)))
    return out


def spans_equal(a: Any, b: Any, s: Any, d: Any, z: Any) -> bool:
    """Every destination span equals its source span, byte for byte (one comparison per span)."""
    return all(bool(torch_equal(b[x : x + n], a[y : y + n]))
               for x, y, n in zip(d.tolist(), s.tolist(), z.tolist(), strict=True))  # fmt: skip


def torch_equal(x: Any, y: Any) -> bool:
    import torch

    return bool(torch.equal(x, y))


def _buffers(torch: Any, drv: Driver) -> tuple[Any, Any, Any, ctypes.c_void_p, Any, tuple[int, Any]]:
    """Source and destination caches (one Llama-3-8B cache of 4,096 blocks each, 8 GiB), torch's
    stream and its handle, a device buffer for span tables and a pinned host one."""
    region = 32 * 64 * 1024 * 4096
    a = torch.randint(0, 256, (region,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(region, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.current_stream()
    table_dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    return a, b, stream, ctypes.c_void_p(stream.cuda_stream), table_dev, drv.pinned(1 << 20)


def gpu_times(args: argparse.Namespace, torch: Any, drv: Driver, result: dict[str, Any]) -> None:
    from kvxfer.cuda_gather import KERNEL_SOURCE, Nvrtc, fill_span_table

    nv = Nvrtc.load()
    arch = (drv.attr(75), drv.attr(76))
    sms = drv.attr(16)
    result["sms"], result["arch"] = sms, arch
    funcs = {}
    for name, (defines, _t, _b, _c) in VARIANTS.items():
        src = KERNEL_SOURCE if name == "shipped" else "".join(f"#define {k} {v}\n" for k, v in defines.items())
        src = src if name == "shipped" else src + VARIANT_SOURCE
        funcs[name] = drv.function(nv.ptx(src, arch))
    a, b, stream, hstream, table_dev, (host, words) = _buffers(torch, drv)
    rows = []

    def timed(fn: Any) -> float:
        times = []
        for i in range(args.reps + 2):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            fn()
            e1.record(stream)
            e1.synchronize()
            if i >= 2:
                times.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(times)

    for label, s, d, z in cases(np.random.default_rng(args.seed)):
        nbytes = int(z.sum())
        flat_a, flat_b = a[:nbytes], b[:nbytes]
        copy_s = timed(lambda fa=flat_a, fb=flat_b: fb.copy_(fa))
        row: dict[str, Any] = {"case": label, "spans": int(z.size), "MiB": nbytes / MiB, "copy_us": copy_s * 1e6,
                               "copy_GBps": nbytes / copy_s / 1e9}  # fmt: skip
        for name, (_d, threads, bps, chunk_kib) in VARIANTS.items():
            chunk = chunk_kib << 10
            dd, ss = d + u64(b.data_ptr()), s + u64(a.data_ptr())
            n = int(z.size)
            total = fill_span_table(words, dd, ss, z, chunk)
            torch.cuda.synchronize()
            drv.check(drv.lib.cuMemcpyHtoDAsync_v2(table_dev.data_ptr(), host, (4 * n + 1) * 8, hstream), "upload")
            targs = (ctypes.c_uint64(table_dev.data_ptr()), ctypes.c_uint32(n), ctypes.c_uint64(chunk))
            params = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in targs))
            grid = max(1, min(total, sms * bps))

            def launch(fn: Any = funcs[name], g: int = grid, t: int = threads, p: Any = params) -> None:
                drv.check(drv.lib.cuLaunchKernel(fn, g, 1, 1, t, 1, 1, 0, hstream, p, None), "cuLaunchKernel")

            b.zero_()
            t = timed(launch)
            ok = spans_equal(a, b, s, d, z)
            row[name] = {"us": t * 1e6, "vs_copy": copy_s / t, "ok": ok, "grid": grid, "threads": threads}
        rows.append(row)
        best = max((k for k in VARIANTS), key=lambda k: row[k]["vs_copy"])
        print(f"{label:22} {row['spans']:5} spans  copy {row['copy_us']:8.1f} us ({row['copy_GBps']:.0f} GB/s)  "
              + "  ".join(f"{k} {row[k]['vs_copy']:.3f}{'' if row[k]['ok'] is not False else ' BAD'}"
                          for k in VARIANTS) + f"  best: {best}", flush=True)  # fmt: skip
    result["gpu"] = rows


# What the thread did before the launch (ms): the sidecar and the worker sleep between pulls, and
# a worker waits on a socket for the sidecar's answer; "spin" keeps the thread in user space
# (perf_counter), "poll" spins on select() with no timeout (a system call per turn) as a client
# that busy-polls its socket would.
# "gpu-sleep" / "gpu-spin": the same, with a tiny kernel queued every 0.5 ms (the GPU never idles long).
# "rehearse": one gather of 16 bytes by the same code just before (a worker could run it while it
# waits for the sidecar's answer).
GAPS = ("none", "sleep 20", "sleep 1", "spin 20", "poll 20", "sleep 20, spin 1", "gpu-sleep 20", "gpu-spin 20",
        "sleep 20, rehearse", "sleep 20, rehearse, sleep 0.5", "sleep 20, rehearse, sleep 1",
        "sleep 20, rehearse, spin 0.5")  # fmt: skip
REHEARSAL: list[Any] = []  # the rehearsal's callable, set by launch_costs


def before(gap: str) -> None:
    """Do what ``gap`` says (one of :data:`GAPS`)."""
    import select
    import socket

    for step in gap.split(", "):
        if step == "none":
            return
        if step == "rehearse":
            REHEARSAL[0]()
            continue
        what, ms = step.split()
        until = time.perf_counter() + float(ms) / 1e3
        if what.startswith("gpu-"):
            import torch

            while time.perf_counter() < until:
                torch.cuda._sleep(1000)  # a kernel of ~1,000 clock cycles
                pause = time.perf_counter() + 5e-4
                if what == "gpu-sleep":
                    time.sleep(5e-4)
                while time.perf_counter() < pause:
                    pass
        elif what == "sleep":
            time.sleep(float(ms) / 1e3)
        elif what == "spin":
            while time.perf_counter() < until:
                pass
        else:
            a, _b = socket.socketpair()
            while time.perf_counter() < until:
                select.select([a], [], [], 0)
            a.close()
            _b.close()


LAST_PHASES = [0.0, 0.0, 0.0]  # the last upload+launch's table fill / upload / launch, us


def launch_ways(drv: Driver, fns: tuple[Any, Any, Any], hstream: Any, table_dev: int, pinned: tuple[int, Any],
                sms: int, dd: Any, ss: Any, z: Any) -> dict[str, Any]:  # fmt: skip
    """The ways to queue one gather: upload + launch, and the table in 4 KiB or 32 KiB of parameters."""
    from kvxfer.cuda_gather import fill_span_table

    plain, small, large = fns
    host, words = pinned
    n = int(z.size)

    def upload() -> None:
        t0 = time.perf_counter()
        total = fill_span_table(words, dd, ss, z)
        t1 = time.perf_counter()
        drv.check(drv.lib.cuMemcpyHtoDAsync_v2(table_dev, host, (4 * n + 1) * 8, hstream), "upload")
        t2 = time.perf_counter()
        targs = (ctypes.c_uint64(table_dev), ctypes.c_uint32(n), ctypes.c_uint64(64 << 10))
        p = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in targs))
        drv.check(drv.lib.cuLaunchKernel(plain, min(total, sms * 16), 1, 1, 512, 1, 1, 0, hstream, p, None), "launch")
        LAST_PHASES[:] = [(t1 - t0) * 1e6, (t2 - t1) * 1e6, (time.perf_counter() - t2) * 1e6]

    ways: dict[str, Any] = {"upload+launch": upload}
    for fname, fn, cap in (("params-4KiB", small, 509), ("params-32KiB", large, 4090)):
        if 4 * n + 1 > cap:
            continue
        tab = np.zeros(cap, dtype=u64)

        def by_params(fn: Any = fn, tab: Any = tab) -> None:
            total = fill_span_table(tab, dd, ss, z)
            targs = (ctypes.c_uint32(n), ctypes.c_uint64(64 << 10))
            p = (ctypes.c_void_p * 3)(ctypes.c_void_p(tab.ctypes.data),
                                      *(ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in targs))  # fmt: skip
            drv.check(drv.lib.cuLaunchKernel(fn, min(total, sms * 16), 1, 1, 512, 1, 1, 0, hstream, p, None), "l")

        ways[fname] = by_params
    return ways


def launch_costs(args: argparse.Namespace, torch: Any, drv: Driver, result: dict[str, Any]) -> None:
    """Host microseconds from the call to a queued launch: upload + launch vs the table in the parameters."""
    from kvxfer.cuda_gather import Nvrtc

    nv = Nvrtc.load()
    arch = (drv.attr(75), drv.attr(76))
    sms = drv.attr(16)
    src = "#define UNROLL 4\n" + VARIANT_SOURCE
    plain = drv.function(nv.ptx(src, arch))
    small = drv.function(nv.ptx("#define PARAM_WORDS 509\n" + src, arch))  # 4 KiB of parameters in all
    large = drv.function(nv.ptx("#define PARAM_WORDS 4090\n" + src, arch))  # 32 KiB (CUDA >= 12.1, sm_70+)
    a, b, _stream, hstream, table_dev, (host, words) = _buffers(torch, drv)
    region = a.numel()
    rng = np.random.default_rng(args.seed)
    out: list[dict[str, Any]] = []
    for label, tokens, max_run in (("2 GiB contiguous", 16384, 4096), ("1 GiB fragmented", 8192, 64)):
        s, d, z = (x.astype(u64) for x in llama_spans(rng, tokens, max_run))
        ways = launch_ways(drv, (plain, small, large), hstream, table_dev.data_ptr(), (host, words), sms,
                           d + u64(b.data_ptr()), s + u64(a.data_ptr()), z)  # fmt: skip
        tiny = np.array([16], dtype=u64)
        REHEARSAL[:] = [launch_ways(drv, (plain, small, large), hstream, table_dev.data_ptr(), (host, words), sms,
                                    tiny + u64(b.data_ptr() + region - 64), tiny + u64(a.data_ptr()), tiny)[
                                        "upload+launch"]]  # fmt: skip
        for way, call in ways.items():
            for gap in GAPS if way == "upload+launch" else ("none", "sleep 20"):
                times, phases = [], []
                for _ in range(args.reps + 3):
                    before(gap)
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                    phases.append(list(LAST_PHASES))
                    torch.cuda.synchronize()
                med = [statistics.median(c) for c in zip(*phases[3:], strict=True)]
                row = {"case": label, "spans": int(z.size), "way": way, "gap": gap,
                       "host_us": statistics.median(times[3:]) * 1e6, "fill_upload_launch_us": med}  # fmt: skip
                out.append(row)
                print(f"launch {label:18} {way:14} after {gap:22}: {row['host_us']:7.1f} us"
                      + (f" (fill {med[0]:.1f}, upload {med[1]:.1f}, launch {med[2]:.1f})"
                         if way == "upload+launch" else ""), flush=True)  # fmt: skip
        for way, call in ways.items():  # each way moved the right bytes too
            b.zero_()
            call()
            torch.cuda.synchronize()
            ok = spans_equal(a, b, s, d, z)
            out.append({"case": label, "way": way, "bytes_ok": ok})
            print(f"launch {label:18} {way:14} bytes {'ok' if ok else 'BAD'}", flush=True)
    result["launch"] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvxfer-gather-variants"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-gpu", action="store_true")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"ok": False}
    try:
        import torch

        torch.zeros(1, device="cuda:0")
        result["gpu_name"] = torch.cuda.get_device_name(0)
        print(result["gpu_name"], flush=True)
        drv = Driver()
        if not args.skip_gpu:
            gpu_times(args, torch, drv, result)
        launch_costs(args, torch, drv, result)
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    (Path(args.out) / "gather_variants.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
