#!/usr/bin/env python3
"""Two sidecars and two GPU workers: KV blocks pulled VRAM to VRAM through ``kvxfer serve`` processes.

Real processes from :class:`kvxfer.harness.cluster.LocalCluster`: a prefill and a decode sidecar
(``python -m kvxfer.server``, NIXL/UCX) and two synthetic workers (``python -m kvxfer.harness.worker_sim
--memory cuda:<dev>``) whose KV caches are torch tensors on the GPU, registered with their sidecar
by CUDA IPC (no copy). The cache is Llama-3-8B's (32 layers, 8 KV heads, head 128, bf16, block 16,
HND: 64 KiB pages, 2 MiB per block over all layers). For each request the prefill worker writes
checkable contents into a fragmented block list and publishes; the decode worker poisons its own
fragmented block list, pulls (its sidecar READs from the prefill sidecar) and verifies every byte.
Block lists: runs of 1 to ``--max-run`` free blocks as a paged allocator leaves them (64 as in
``kvxfer bench transport``), and fully contiguous lists (the best case: one descriptor per layer).

Figures: the sidecar's data-plane time (READ posted -> done) and the worker's end-to-end pull
latency, as GB/s and as a fraction of the device-to-device copy rate measured in the same run
(torch, bytes moved once; across GPUs, the copy between them).

  python3 bench/gpu/sidecar_vram_bench.py --out $OUT                     # one GPU
  python3 bench/gpu/sidecar_vram_bench.py --out $OUT --decode-device 1   # prefill GPU 0 -> decode GPU 1
  .venv/bin/python bench/gpu/sidecar_vram_bench.py --cpu-smoke           # the same flow on shared memory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kvxfer

import numpy as np


def llama3_8b(num_blocks: int) -> Any:
    from kvxfer.layout import KVCacheLayout

    return KVCacheLayout.attention(num_layers=32, num_blocks=num_blocks, block_size=16, num_kv_heads=8,
                                   head_size=128, dtype="bf16", order="HND")  # fmt: skip


def smoke_layout(num_blocks: int) -> Any:
    from kvxfer.layout import KVCacheLayout

    return KVCacheLayout.attention(num_layers=4, num_blocks=num_blocks, block_size=16, num_kv_heads=8, head_size=64)


def copy_rate(nbytes: int, src: int | None, dst: int | None) -> float:
    """GB/s of a device copy (torch, CUDA events, median of 20, bytes moved once); numpy on the CPU."""
    if src is None or dst is None:
        a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        b = np.empty_like(a)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9
    import torch

    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    times = []
    for _ in range(20):
        with torch.cuda.device(src):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def proto_lines(log: Path) -> list[str]:
    """What UCX_PROTO_INFO said about READ (get) of GPU memory."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for i, ln in enumerate(lines):
        if "remote memory read" in ln:
            # A header, rules and column titles, then one row per size range ("| 0..inf | zero-copy | cuda_ipc/cuda |").
            out += [ln.strip(), *[x.strip() for x in lines[i + 1 : i + 9] if ".." in x][:3]]
        elif "software emulation" in ln or "nvlinks" in ln:
            out.append(ln.strip())
    return out[:12]


def read_phases(log: Path) -> dict[str, dict[str, float]]:
    """Median submit / GPU / wake-up microseconds of the decode sidecar's same-host READs, by READ size (debug log)."""
    by_size: dict[str, dict[str, list[float]]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"same-host READ phases"' in line:
            rec = json.loads(line)
            phases = by_size.setdefault(f"{rec.get('bytes', 0) / 2**20:.0f} MiB", {})
            for k in ("translate_us", "submit_us", "gpu_us", "wake_us", "polls"):
                if rec.get(k) is not None:
                    phases.setdefault(k, []).append(float(rec[k]))
            split = rec.get("kernel_table_upload_launch_us")
            if split:
                for k, v in zip(("table_us", "upload_us", "launch_us"), split, strict=True):
                    phases.setdefault(k, []).append(float(v))
    return {
        size: {k: round(statistics.median(v), 1) for k, v in phases.items()} | {"reads": len(phases["gpu_us"])}
        for size, phases in by_size.items()
    }


#: A pull's way, on the monotonic clock every process of the host shares: worker call -> fast socket
#: frame in -> the sidecar's Pull -> its transfer started -> answer ready -> answer written -> worker back.
PULL_SEGMENTS = ("to_sidecar", "to_pull", "validate", "run", "to_answer", "to_worker")


def pull_phases(log: Path, marks: dict[str, tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Median microseconds of each of :data:`PULL_SEGMENTS` per row label, from the decode sidecar's debug log.

    ``marks``: request id -> (row label, the worker's call time, its return time).
    """
    fast: dict[str, dict[str, float]] = {}
    pulls: dict[str, dict[str, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"fast-socket call"' in line or '"pull answered"' in line:
            rec = json.loads(line)
            rid = rec.get("request_id", "")
            if rec["msg"] == "fast-socket call" and rec.get("method", "").endswith("/Pull"):
                fast[rid] = rec
            elif rec["msg"] == "pull answered":
                pulls[rid] = rec
    out: dict[str, dict[str, list[float]]] = {}
    for rid, (label, t_call, t_done) in marks.items():
        f, p = fast.get(rid), pulls.get(rid)
        if f is None or p is None:
            continue
        points = (t_call, f["arrived"], p["entered"], p["started"], p["answering"], f["answered"], t_done)
        seg = out.setdefault(label, {k: [] for k in PULL_SEGMENTS})
        for k, a, b in zip(PULL_SEGMENTS, points, points[1:], strict=False):
            seg[k].append((b - a) * 1e6)
    return {
        label: {k: round(statistics.median(v), 1) for k, v in seg.items()} | {"pulls": len(seg["run"])}
        for label, seg in out.items()
    }


def pin(pid: int, cpus: set[int]) -> list[int]:
    """Pin every thread of process ``pid`` to ``cpus`` (threads it starts later inherit it); the cpus set."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return sorted(os.sched_getaffinity(pid))


def pin_plan(pids: dict[str, int], width: int) -> dict[str, list[int]]:
    """Give each process ``width`` cores of its own, this one first, in the order given; {} when too few cores."""
    have = sorted(os.sched_getaffinity(0))
    names = ["bench", *pids]
    if len(have) < width * len(names):
        return {}
    plan = {name: set(have[i * width : (i + 1) * width]) for i, name in enumerate(names)}
    pinned = {"bench": pin(os.getpid(), plan["bench"])}
    pinned.update({name: pin(pid, plan[name]) for name, pid in pids.items()})
    return pinned


def run(args: argparse.Namespace) -> dict[str, Any]:
    smoke = args.cpu_smoke
    layout = (smoke_layout if smoke else llama3_8b)(args.blocks)
    memory_p = "shm" if smoke else "cuda:0"
    memory_d = "shm" if smoke else f"cuda:{args.decode_device}"
    facts: dict[str, Any] = {"layout": layout.to_dict(), "page_bytes": layout.page_bytes,
                             "memory": [memory_p, memory_d]}  # fmt: skip
    if not smoke:
        import torch

        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["torch"] = torch.__version__
    copy_bytes = 1 << 30 if not smoke else 64 << 20
    src, dst = (None, None) if smoke else (0, args.decode_device)
    copy = copy_rate(copy_bytes, src, dst)
    facts["copy_GBps"] = copy
    if not smoke and args.decode_device != 0:
        facts["copy_same_gpu_GBps"] = copy_rate(copy_bytes, 0, 0)
    print(f"device copy {src}->{dst}: {copy:.0f} GB/s (bytes moved once)", flush=True)
    if args.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"  # the sidecars inherit it; tables land in their logs
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    block_lists = [(args.max_run, f"fragmented (runs 1..{args.max_run})"), (layout.num_blocks, "contiguous")]
    plans = [
        (("cuda-ipc" if not smoke else "default") + ("" if smoke else f"-{gather}") + (f"-{tag}" if tag else ""),
         {"KVXFER_CUDA_GATHER": gather, **extra},
         block_lists, args.sizes, args.reps, "")
        for gather in args.gathers for tag, extra in args.sidecar_env
    ]  # fmt: skip
    if args.worker_gather and not smoke:
        # The same sidecars, the decode worker launching each gather itself (PullRequest.worker_gather).
        plans += [(f"{p[0]}-in-worker", *p[1:]) for p in list(plans)] + (
            [(f"{p[0]}-in-worker-cold", *p[1:]) for p in list(plans)] if args.worker_gather_cold else []
        )  # fmt: skip
    if not smoke and args.nixl_reps:
        # The same sidecars with the same-host shortcut off: what NIXL/UCX does with IPC-opened memory.
        plans.append(("nixl", {"KVXFER_CUDA_IPC_DIRECT": "false"}, block_lists, args.sizes[:1], args.nixl_reps, ""))
    if args.worker_agents:
        # --backend worker: each worker's own NIXL agent registered its tensors (the route to a NIC).
        plans.append(("worker-agent", {}, block_lists, args.sizes, args.reps, "nixl"))
    for path, env, lists, sizes, reps, agent in plans:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget reached; {path} path not run", flush=True)
            break
        rows += run_cluster(args, layout, (memory_p, memory_d), path, env, lists, sizes, reps, rng, copy, facts,
                            t_start, agent=agent)  # fmt: skip
    ok = bool(rows) and all(r["mismatched_bytes"] == 0 and r["verified_bytes"] > 0 for r in rows)
    if args.with_nixl_agents:  # the baseline: two NIXL agents owning their caches, the same block lists
        from nixl_agents_bench import bench_agents, comparison, markdown

        agents = bench_agents(layout, memory="dram" if smoke else "vram", devices=(0, args.decode_device),
                              sizes=args.sizes, reps=args.reps, max_run=args.max_run, seed=args.seed, copy_gbps=copy,
                              budget_s=max(1.0, args.budget_s - (time.perf_counter() - t_start)),
                              proto_info=args.proto_info, log_dir=Path(args.out))  # fmt: skip
        rows += agents["rows"]
        facts["nixl_agents"] = {**agents["facts"], "stopped_early": agents["stopped_early"], "ok": agents["ok"]}
        ok = ok and agents["ok"]
        print(markdown(agents) + "\n\n" + comparison(rows), flush=True)
    return {"ok": ok, "facts": facts, "rows": rows, "wall_s": time.perf_counter() - t_start}


def run_cluster(
    args: argparse.Namespace, layout: Any, memory: tuple[str, str], path: str, env: dict[str, str],
    lists: list[tuple[int, str]], sizes: list[int], reps: int, rng: np.random.Generator, copy: float,
    facts: dict[str, Any], t_start: float, *, agent: str = "",
) -> list[dict[str, Any]]:  # fmt: skip
    """One prefill/decode pair of sidecars and workers; every (block list, size) pulled ``reps`` times.

    ``agent``: the workers run that data plane themselves and the sidecars ``--backend worker``.
    """
    from kvxfer.harness.cluster import BlockAllocator, ClusterError, LocalCluster

    # Unix socket paths must stay under 108 bytes: the cluster lives under /tmp, not under --out.
    workdir = Path(tempfile.mkdtemp(prefix="kvx-gpu-"))
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    backend = "worker" if agent else "nixl"
    level = "debug" if args.phases else "warning"
    with LocalCluster(backend=backend, workdir=str(workdir), log_level=level) as cluster:
        pre = cluster.start_sidecar("prefill-0", "prefill", "prefill", env=env)
        dec = cluster.start_sidecar("decode-0", "decode", "decode", env=env)
        pw = cluster.start_worker("prefill-w0", pre, {"kv": layout}, (0, 1), watch=True, memory=memory[0], agent=agent)
        dw = cluster.start_worker("decode-w0", dec, {"kv": layout}, (0, 1), memory=memory[1], agent=agent,
                                  worker_gather="-in-worker" in path,
                                  gather_warm_up=not path.endswith("-in-worker-cold"))  # fmt: skip
        cluster.wait_workers(timeout=300)
        if args.pin_cpus:  # each process on cores of its own: is a READ's CPU side slow from sharing them?
            procs = {"decode-sidecar": dec.proc.pid, "prefill-sidecar": pre.proc.pid, "decode-worker": dw.proc.pid,
                     "prefill-worker": pw.proc.pid}  # fmt: skip
            facts[f"pinned_{path}"] = pinned = pin_plan(procs, args.pin_cpus)
            print(f"[{path}] pinned: {pinned or 'not enough cores'}", flush=True)
        facts[f"setup_s_{path}"] = time.perf_counter() - t0
        print(f"[{path}] cluster up in {time.perf_counter() - t0:.1f} s", flush=True)
        n = 0

        def one(max_run: int, blocks: int, tag: str, mode: str) -> dict[str, Any]:
            nonlocal n
            n += 1
            p_alloc = BlockAllocator(layout.num_blocks, rng, max_run)
            d_alloc = BlockAllocator(layout.num_blocks, rng, max_run)
            p_ids, d_ids = p_alloc.allocate(blocks), d_alloc.allocate(blocks)
            rid = f"{tag}-{n}"
            try:
                fill = pw.call("prefill", rid, {"kv": p_ids}, 1000 + n, 0.0, timeout=600)
                if mode == "lookup":  # no publisher block ids: the sidecar asks the publisher (GetPublished)
                    res = dw.call("pull", rid, [pre.peer_address], {"kv": d_ids}, 1000 + n, "prefill", timeout=600)
                else:  # granted: expected on arrival (its Hold returns a grant), ids from kv_transfer_params
                    dw.call("expect", rid, [pre.peer_address], timeout=60)
                    time.sleep(args.expect_lead_ms / 1e3)  # the scheduler's queueing before blocks exist
                    if mode == "prepared":  # the scheduler, as vLLM allocates the blocks: the pull to come
                        got = dw.call("prepare", rid, [pre.peer_address], {"kv": d_ids}, "prefill", {"kv": p_ids},
                                      timeout=60)  # fmt: skip
                        if not got["prepared"]:
                            raise ClusterError(f"{rid}: the decode sidecar did not plan the pull ahead")
                        time.sleep(args.prepare_lead_ms / 1e3)  # from allocation to the worker's start_load_kv
                    res = dw.call("pull", rid, [pre.peer_address], {"kv": d_ids}, 1000 + n, "prefill",
                                  {"kv": p_ids}, timeout=600)  # fmt: skip
            except ClusterError as exc:
                raise ClusterError(f"{exc}\n{cluster.logs(40)}") from None
            res["fill_s"] = fill["fill_s"]
            res["rid"] = rid
            return res

        cases = [(m, lab, t, mode) for m, lab in lists for t in sizes for mode in args.modes]
        marks: dict[str, tuple[str, float, float]] = {}
        for max_run, label, tokens, mode in cases:
            blocks = -(-tokens // layout.block_size)
            one(max_run, blocks, "warm", mode)  # first pull: handshake, UCX endpoints, IPC mappings
            got = [one(max_run, blocks, "bench", mode) for _ in range(reps)]
            for r in got:
                if "t_call" in r:
                    marks[r["rid"]] = (f"{label} {tokens} tok {mode}", r["t_call"], r["t_done"])
            nbytes = got[0]["bytes"]
            data = statistics.median(r["data_s"] for r in got)
            lat = statistics.median(r["latency_s"] for r in got)
            row = {
                "path": f"{path}+{mode}", "blocks": label, "tokens": tokens, "MiB": nbytes / 2**20,
                "fetch_ms": statistics.median(r["fetch_s"] for r in got) * 1e3,
                "sidecar_ms": statistics.median(r["duration_s"] for r in got) * 1e3,
                "descriptors": statistics.median(r["descriptors"] for r in got),
                "data_GBps": nbytes / data / 1e9, "e2e_GBps": nbytes / lat / 1e9,
                "best_data_GBps": nbytes / min(r["data_s"] for r in got) / 1e9,
                "data_ms": data * 1e3, "latency_ms": lat * 1e3,
                "verified_bytes": sum(r["checked"] - r["mismatched"] for r in got),
                "mismatched_bytes": sum(r["mismatched"] for r in got), "reps": len(got),
            }  # fmt: skip
            if got[0].get("gather_us"):  # the worker's gather: where its time went (median us)
                row["worker_gather_us"] = {k: statistics.median(r["gather_us"][k] for r in got)
                                           for k in got[0]["gather_us"]}  # fmt: skip
            row["data_vs_copy"] = row["data_GBps"] / copy
            row["e2e_vs_copy"] = row["e2e_GBps"] / copy
            rows.append(row)
            print(
                f"[{row['path']}] {label:26} {tokens:6} tok {row['MiB']:6.0f} MiB {row['descriptors']:5.0f} desc  "
                f"data {row['data_GBps']:7.1f} GB/s ({row['data_vs_copy']:.3f} of copy, "
                f"{row['data_ms']:.2f} ms)  e2e {row['e2e_GBps']:6.1f} GB/s ({row['latency_ms']:.2f} ms; sidecar "
                f"{row['sidecar_ms']:.2f}, lookup {row['fetch_ms']:.2f})  "
                f"verified {row['verified_bytes']:,} B, bad {row['mismatched_bytes']}"
                + (f"  worker us {row['worker_gather_us']}" if "worker_gather_us" in row else ""),
                flush=True,
            )
            if time.perf_counter() - t_start > args.budget_s:
                print("budget reached; stopping", flush=True)
                break
        facts[f"sidecar_exit_codes_{path}"] = cluster.stop()
        log = workdir / "decode-0.log"  # the reader's side: UCX's protocol choice, fallback warnings
        if args.keep_logs and log.exists():
            shutil.copy(log, Path(args.out) / f"decode-0-{path}.log")
        facts[f"ucx_read_protocol_{path}"] = proto_lines(workdir / "decode-0.log")
        if args.phases:
            facts[f"read_phases_{path}"] = read_phases(workdir / "decode-0.log")
            for size, ph in facts[f"read_phases_{path}"].items():
                print(f"[{path}] same-host READ phases of {size}, median us: {ph}", flush=True)
            facts[f"pull_phases_{path}"] = pull_phases(workdir / "decode-0.log", marks)
            for label, ph in facts[f"pull_phases_{path}"].items():
                print(f"[{path}] pull phases, {label}, median us: {ph}", flush=True)
        facts[f"fallback_warnings_{path}"] = [
            ln[:300] for ln in (workdir / "decode-0.log").read_text(errors="replace").splitlines()
            if "CUDA IPC READ unavailable" in ln or "gather kernel is unavailable" in ln
        ][:3]  # fmt: skip
    shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvxfer-gpu-bench"))
    ap.add_argument("--cpu-smoke", action="store_true", help="shared memory, a small layout: checks the flow here")
    ap.add_argument("--decode-device", type=int, default=0, help="GPU of the decode worker (prefill is on 0)")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per worker (default 2048 = 4 GiB; smoke 256)")
    ap.add_argument("--sizes", default="", help="request sizes in tokens (default 1024,8192; smoke 128,1024)")
    ap.add_argument("--reps", type=int, default=0, help="timed pulls per size (default 4; smoke 2)")
    ap.add_argument("--max-run", type=int, default=64, help="longest run of contiguous blocks in a fragmented list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--no-proto-info", dest="proto_info", action="store_false")
    ap.add_argument("--keep-logs", action="store_true", help="copy the decode sidecars' logs to --out")
    ap.add_argument("--nixl-reps", type=int, default=2, help="pulls per case with the shortcut off (0: skip)")
    ap.add_argument("--gathers", default="kernel", help="--cuda-gather values to run, each a pair of sidecars "
                    "(kernel,copy-engine)")  # fmt: skip
    ap.add_argument(
        "--modes", default="lookup,granted",
        help="lookup: pull with no publisher ids (GetPublished first); granted: expect, then pull with the ids "
        "(READ on the grant); prepared: granted, and the pull is prepared (Prepare, as the vLLM scheduler sends "
        "it) --prepare-lead-ms before it",
    )  # fmt: skip
    ap.add_argument(
        "--prepare-lead-ms", type=float, default=1.0,
        help="prepared: between the Prepare's answer and the Pull (vLLM: from allocation to start_load_kv)",
    )  # fmt: skip
    ap.add_argument("--expect-lead-ms", type=float, default=20.0, help="granted: between Expect and Pull")
    ap.add_argument(
        "--sidecar-env",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="a sidecar pair run with these KVXFER_* settings too (repeatable; one run each)",
    )
    ap.add_argument("--phases", action="store_true", help="debug logs on the sidecars: where a READ's time goes")
    ap.add_argument(
        "--pin-cpus",
        type=int,
        default=0,
        metavar="N",
        help="pin this script, each sidecar and each worker to N cores of its own (0: no pinning)",
    )
    ap.add_argument(
        "--worker-gather",
        action="store_true",
        help="each gather path also with the decode worker launching the gathers itself",
    )
    ap.add_argument(
        "--worker-gather-cold",
        action="store_true",
        help="with --worker-gather: also with the worker's warm-up off (WorkerGather(warm_up=False))",
    )
    ap.add_argument("--with-nixl-agents", action="store_true", help="then nixl_agents_bench.py on the same lists")
    ap.add_argument(
        "--worker-agents",
        action="store_true",
        help="also sidecars with --backend worker: each worker's own NIXL agent moves the bytes",
    )
    args = ap.parse_args()
    smoke = args.cpu_smoke
    args.blocks = args.blocks or (256 if smoke else 2048)
    args.sizes = [int(x) for x in (args.sizes or ("128,1024" if smoke else "1024,8192")).split(",")]
    args.reps = args.reps or (2 if smoke else 4)
    args.gathers = args.gathers.split(",")
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - {"lookup", "granted", "prepared"})
    if unknown:
        ap.error(f"--modes: unknown {unknown[0]!r}; known: lookup, granted, prepared")
    # One (tag, env) per sidecar pair: the defaults, then each --sidecar-env.
    from kvxfer.harness.cluster import parse_sidecar_env

    try:
        args.sidecar_env = [("", {})] + [(e.replace("KVXFER_", "").lower(), parse_sidecar_env(e))
                                         for e in args.sidecar_env]  # fmt: skip
    except ValueError as exc:
        ap.error(f"--sidecar-env: {exc}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        result = run(args)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], flush=True)
    (Path(args.out) / "sidecar_bench.json").write_text(json.dumps(result, indent=1, default=str))
    facts = result.get("facts", {})
    for key, lines in facts.items():
        if key.startswith(("ucx_read_protocol", "fallback_warnings")):
            for line in lines:
                print(f"{key}: {line}")
    print(json.dumps({"ok": result["ok"], "copy_GBps": facts.get("copy_GBps"),
                      "rows": [{k: r[k] for k in ("path", "blocks", "tokens", "data_GBps", "data_vs_copy", "e2e_GBps",
                                                  "descriptors", "verified_bytes", "mismatched_bytes")}
                               for r in result.get("rows", [])]}, default=str))  # fmt: skip
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
