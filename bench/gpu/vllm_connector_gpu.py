"""The vLLM connector's two halves on a GPU: vLLM-shaped CUDA caches, real sidecar processes.

vLLM itself cannot be brought to the lent GPU machine (no network there, and its wheel is far over
the size that travels), so this drives :class:`~kvxfer.integrations.vllm.scheduler.SchedulerSide`
and :class:`~kvxfer.integrations.vllm.worker.WorkerSide` exactly as ``KvxferConnector`` does, on
cache tensors laid out as vLLM 0.32 lays them out on a GPU (LBHNC: one ``cudaMalloc`` allocation,
per-layer views ``(num_blocks, kv_heads, block_size, 2*head_size)``). The prefill scheduler
publishes, the decode worker pulls into its own cache through its sidecar, and every byte is
compared on the GPU. Also runs on the CPU (``--cpu-smoke``: shared-memory caches), which is how it
was tested before its device run.

    python3 bench/gpu/vllm_connector_gpu.py --out /tmp/out            # GPU
    python bench/gpu/vllm_connector_gpu.py --cpu-smoke --blocks 256   # here
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_MODULES", "^efa")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
from sidecar_vram_bench import copy_rate  # this directory: the device-copy reference of bench/gpu

from kvxfer.harness.cluster import LocalCluster, parse_sidecar_env
from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.plan import StepPlan
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import CacheGroup
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.layout import KVCacheLayout
from kvxfer.topology import RankInfo


class Req:
    """The fields of vllm.v1.request.Request that the scheduler side reads."""

    def __init__(self, rid: str, tokens: int, params: dict[str, Any], status: str, computed: int = 0) -> None:
        self.request_id = rid
        self.prompt_token_ids = list(range(tokens))
        self.kv_transfer_params = params
        self.status = status
        self.num_computed_tokens = computed


def fragmented(rng: np.random.Generator, free: list[int], n: int) -> list[int]:
    """``n`` block ids taken from ``free`` in runs of 1 to 64 (as an allocator hands them out)."""
    out: list[int] = []
    while len(out) < n:
        start = int(rng.integers(0, len(free)))
        run = min(int(rng.integers(1, 65)), n - len(out), len(free) - start)
        out.extend(free[start : start + run])
        del free[start : start + run]
    return out


def caches(args: argparse.Namespace, device: str, seed: int) -> dict[str, torch.Tensor]:
    """vLLM's LBHNC cache: one allocation, one view per layer."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (args.layers, args.blocks, args.heads, args.block_size, 2 * args.head_size)
    whole = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(args.layers)}


def group(args: argparse.Namespace, kv: dict[str, torch.Tensor]) -> CacheGroup:
    """What ``describe_caches`` makes of those caches (vLLM's HND attention layout, one region a layer)."""
    layout = KVCacheLayout.attention(
        num_layers=args.layers, num_blocks=args.blocks, block_size=args.block_size, num_kv_heads=args.heads,
        head_size=args.head_size, dtype="bf16", order="HND",
    )  # fmt: skip
    return CacheGroup("attn", 0, layout, tuple(kv), tuple(int(t.data_ptr()) for t in kv.values()))


def same(dst: torch.Tensor, d_blocks: list[int], src: torch.Tensor, s_blocks: list[int]) -> bool:
    """Every moved token equal: all of every block but the last, whose last token slot is the decode side's."""
    full = torch.equal(dst[d_blocks[:-1]].view(torch.uint8), src[s_blocks[:-1]].view(torch.uint8))
    last = torch.equal(dst[d_blocks[-1], :, :-1].view(torch.uint8), src[s_blocks[-1], :, :-1].view(torch.uint8))
    return full and last


def prefill_half(argv: dict[str, Any], socket: str, conn: Any) -> None:
    """The prefill instance (worker and scheduler halves) in its own process, driven over ``conn``."""
    args = argparse.Namespace(**argv)
    device = "cpu" if args.cpu_smoke else "cuda:0"
    sp = ConnectorSettings(sidecar_socket=socket)
    pw = WorkerSide(sp, rank=RankInfo(0, 1), local_rank=0)
    pk = caches(args, device, 1)
    pw.register([group(args, pk)], pk)
    ps = SchedulerSide(sp, engine_id="vllm-p", groups=[TransferGroup(0, "attn", "full", args.block_size)])
    conn.send(pw.shared.how if pw.shared else "")
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "publish":
                _, rid, tokens, p_blocks = msg
                keep, params = ps.request_finished(
                    Req(rid, tokens, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED", tokens), [p_blocks]
                )
                assert keep
                assert params is not None
                pw.on_step(ps.build_plan())
                conn.send(params)
            elif msg[0] == "sent":
                wait(pw, sending=msg[1])
                conn.send("ok")
            else:
                return
    finally:
        pw.close()
        ps.close()


def wait(worker: WorkerSide, *, sending: str | None = None, recving: str | None = None) -> None:
    got_s: set[str] = set()
    got_r: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s, r, _cached = worker.finished()
        got_s |= s
        got_r |= r
        if (sending is None or sending in got_s) and (recving is None or recving in got_r):
            return
        time.sleep(0.0005)
    raise SystemExit(f"timeout waiting for sending={sending} recving={recving}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--prompt-blocks", default="8,64,512,2048", help="request sizes in blocks")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gather", choices=("sidecar", "worker"), default="sidecar", help="the decode side's gather")
    ap.add_argument(
        "--expect-lead-ms",
        type=float,
        default=0.0,
        help="between the decode scheduler's match (its Expect) and the blocks: a request's queueing",
    )
    ap.add_argument(
        "--step-lead-ms", type=float, default=0.0,
        help="between vLLM allocating the blocks (the scheduler's Prepare) and the workers' step (their pulls); "
        "the pull is timed from the step",
    )  # fmt: skip
    ap.add_argument("--no-prepare", action="store_true", help="the connector's prepare_pulls off")
    ap.add_argument(
        "--sidecar-env", default="", metavar="K=V[,K=V]",
        help="KVXFER_* settings for both sidecars (e.g. KVXFER_BUSY_POLL_SECONDS=0.1)",
    )  # fmt: skip
    args = ap.parse_args()
    try:
        sidecar_env = parse_sidecar_env(args.sidecar_env)
    except ValueError as exc:
        ap.error(f"--sidecar-env: {exc}")
    device = "cpu" if args.cpu_smoke else "cuda:0"
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu",
                              "sidecar_env": sidecar_env, "prepare_pulls": not args.no_prepare,
                              "step_lead_ms": args.step_lead_ms}  # fmt: skip
    gpu = None if args.cpu_smoke else 0
    report["copy_gbps"] = copy_rate((256 << 20) if args.cpu_smoke else (1 << 30), gpu, gpu)
    print(f"device copy: {report['copy_gbps']:.0f} GB/s", flush=True)
    rows = []
    with LocalCluster(log_level="warning") as cluster:
        p = cluster.start_sidecar("p-0", "prefill", "prefill", env=sidecar_env)
        d = cluster.start_sidecar("d-0", "decode", "decode", env=sidecar_env)
        # The prefill instance's worker runs in a process of its own, as vLLM's does: the decode side
        # maps its memory by CUDA IPC from another process (a process cannot open its own handles).
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        p_socket = str(Path(p.local_socket).parent / "p-{rank}.sock")
        prefill = ctx.Process(target=prefill_half, args=(vars(args), p_socket, child_conn), daemon=True)
        prefill.start()
        sd = ConnectorSettings(sidecar_socket=str(Path(d.local_socket).parent / "d-{rank}.sock"), gather=args.gather,
                               prepare_pulls=not args.no_prepare)  # fmt: skip
        dw = WorkerSide(sd, rank=RankInfo(0, 1), local_rank=0)
        pk, dk = caches(args, device, 1), caches(args, device, 2)  # pk: what the prefill process made (same seed)
        t0 = time.perf_counter()
        dw.register([group(args, dk)], dk)
        report["memory"] = conn.recv()
        report["register_s"] = time.perf_counter() - t0
        report["gather"] = "worker" if dw.gather is not None else "sidecar"
        ds = SchedulerSide(sd, engine_id="vllm-d", groups=[TransferGroup(0, "attn", "full", args.block_size)])
        page = group(args, dk).layout.page_bytes
        n_req = 0
        try:
            for nb in [int(x) for x in args.prompt_blocks.split(",")]:
                for rep in range(args.reps + 1):  # the first of each size is a warm-up
                    n_req += 1
                    p_blocks = fragmented(rng, list(range(args.blocks)), nb)
                    d_blocks = fragmented(rng, list(range(args.blocks)), nb)
                    tokens = nb * args.block_size
                    rid = f"r{n_req}"
                    t_pub = time.perf_counter()
                    conn.send(("publish", rid, tokens, p_blocks))
                    params = conn.recv()
                    t_pull = time.perf_counter()
                    dreq = Req("d" + rid, tokens, dict(params), "RUNNING")
                    # The decode side computes the last prompt token itself: every token but that one moves.
                    assert ds.matched_tokens(dreq, 0) == (tokens - 1, True)  # Expect: its publish is held
                    if args.expect_lead_ms:  # the request waits in vLLM's queue before it gets blocks
                        time.sleep(args.expect_lead_ms / 1e3)
                    ds.after_alloc(dreq, [d_blocks], tokens - 1)
                    plan: StepPlan = ds.build_plan()
                    if args.step_lead_ms:  # the rest of vLLM's step before the workers' start_load_kv
                        time.sleep(args.step_lead_ms / 1e3)
                    t_alloc = time.perf_counter()
                    dw.on_step(plan)
                    wait(dw, recving="d" + rid)
                    t_done = time.perf_counter()
                    errors = dw.load_errors()
                    ok = not errors and all(same(dk[n], d_blocks, pk[n], p_blocks) for n in pk)
                    conn.send(("sent", rid))
                    assert conn.recv() == "ok"
                    ds.loads_finished({"d" + rid})
                    nbytes = (nb * args.block_size - 1) * (page // args.block_size) * args.layers
                    row = {"blocks": nb, "bytes": nbytes, "warmup": rep == 0, "verified": ok,
                           "publish_ms": 1000 * (t_pull - t_pub), "pull_ms": 1000 * (t_done - t_alloc),
                           "gbps": nbytes / (t_done - t_alloc) / 1e9,
                           "worker_us": dict(dw.gather.last) if dw.gather is not None else {}}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if not ok:
                        raise SystemExit(f"bytes differ for {rid} (load errors {sorted(errors)[:8]})")
            report["worker_gather_usable"] = dw.gather.usable if dw.gather is not None else None
        finally:
            conn.send(("stop",))
            prefill.join(timeout=30)
            for x in (dw, ds):
                x.close()
    report["rows"] = rows
    summary = {}
    for nb in sorted({r["blocks"] for r in rows}):
        timed = [r for r in rows if r["blocks"] == nb and not r["warmup"]]
        med = statistics.median(r["gbps"] for r in timed)
        summary[nb] = {"bytes": timed[0]["bytes"], "median_gbps": med, "of_copy": med / report["copy_gbps"],
                       "median_pull_ms": statistics.median(r["pull_ms"] for r in timed),
                       "median_publish_ms": statistics.median(r["publish_ms"] for r in timed)}  # fmt: skip
    report["summary"] = summary
    report["verified_bytes"] = sum(r["bytes"] for r in rows if r["verified"])
    print(json.dumps({"summary": summary, "copy_gbps": report["copy_gbps"], "memory": report["memory"],
                      "verified_bytes": report["verified_bytes"]}, indent=1))  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "vllm_connector_gpu.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
