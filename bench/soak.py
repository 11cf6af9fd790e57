"""Soak: many transfers with randomly drawn layouts, TP pairs and block lists, every byte verified.

Each *configuration* draws a model shape (attention, quantized fp8/int8/nvfp4, MLA, or a hybrid
attention + Mamba model), a physical order and cross-layer packing per side, block sizes that are
multiples of each other, and a (prefill TP, decode TP) pair; it then starts one real sidecar per
rank (grpc.aio + NIXL, in this process, on loopback) with a synthetic worker per rank, and runs
its share of the transfers with ``--concurrency`` requests in flight, fragmented block lists of
random length. Sidecars are reused for every transfer of a configuration. Every decode rank checks
every byte it received against the request's expected contents.

``--mode``: ``pull``, ``push`` (the decode ranks offer their blocks, then the prefill ranks
publish and their sidecars WRITE) or ``mixed`` (each transfer draws one). ``--faults`` is the share
of push transfers that fail on purpose: the decode side aborts while the WRITEs may be in flight,
or gives up on a prefill that never publishes. Such a transfer must end ABORTED or
DEADLINE_EXCEEDED (or done, verified, when the abort came too late), and its decode blocks are
poisoned again once the abort returned and watched before they are reused: a single byte that
lands in them after that (a WRITE past the Revoke fence) is a failure.

    python bench/soak.py [--transfers 10000] [--configs 16] [--concurrency 8] [--seed 0]
                         [--mode mixed] [--faults 0.1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("UCX_MODULES", "^efa")  # see tests/sidecar/conftest.py: avoids an exit-time crash
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs each agent's start on stdout: keep --json clean

from kvxfer.client import AsyncClient, KvxferRpcError
from kvxfer.config import load_settings
from kvxfer.errors import KvxferError
from kvxfer.harness.cluster import BlockAllocator
from kvxfer.harness.worker_sim import fill_blocks, poison_blocks, still_poisoned, verify_blocks
from kvxfer.layout import KVCacheLayout, head_range
from kvxfer.memory import SharedKVBuffer
from kvxfer.server.app import Sidecar
from kvxfer.topology import RankInfo, TransferTopology

#: How long a given-up push's decode blocks are watched for a late WRITE before they are reused.
FENCE_CHECK_S = 0.2
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4)]


@dataclass
class Config:
    """One drawn configuration: per-rank layouts of each cache group on each side."""

    label: str
    prefill_tp: int
    decode_tp: int
    prefill: dict[str, KVCacheLayout]  # group -> layout of one prefill rank
    decode: dict[str, KVCacheLayout]


def draw_config(rng: np.random.Generator, idx: int) -> Config:
    """A random, valid configuration."""
    kind = rng.choice(["attention", "attention", "quantized", "mla", "hybrid"])
    p_tp, d_tp = TP_PAIRS[int(rng.integers(len(TP_PAIRS)))]
    if kind == "hybrid":  # a Mamba page is opaque: same TP on both sides
        d_tp = p_tp
    layers = int(rng.integers(1, 7))
    bs_p = int(rng.choice([8, 16, 32]))
    bs_d = bs_p * int(rng.choice([1, 1, 2])) if rng.random() < 0.5 else max(bs_p // int(rng.choice([1, 2])), 4)
    heads = int(rng.choice([1, 2, 4, 8]))
    orders = [str(rng.choice(["HND", "NHD"])), str(rng.choice(["HND", "NHD"]))]
    if rng.random() < 0.7:
        orders[1] = orders[0]
    cross = [bool(rng.random() < 0.25), bool(rng.random() < 0.25)]
    nb = 256

    def attn(side: int, tp: int, bs: int) -> KVCacheLayout:
        h0, h1 = head_range(heads, tp, 0)
        if kind == "quantized":
            dtype = str(rng_side[side].choice(["fp8_e4m3", "int8", "nvfp4"]))
            hs = int(rng_side[side].choice([16, 32, 64]))
            order = "HND" if dtype == "nvfp4" else orders[side]  # nvfp4 pages are HND (data then scales per side)
            return KVCacheLayout.quantized(num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=h1 - h0,
                                           total_kv_heads=heads, head_size=hs, dtype=dtype, order=order,
                                           cross_layer=cross[side])  # fmt: skip
        return KVCacheLayout.attention(num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=h1 - h0,
                                       total_kv_heads=heads, head_size=head_size, dtype=dtype_a,
                                       order=orders[side], cross_layer=cross[side])  # fmt: skip

    # Both sides must agree on dtype and head size: draw them once (same seed for both sides).
    side_seed = int(rng.integers(1 << 30))
    rng_side = [np.random.default_rng(side_seed), np.random.default_rng(side_seed)]
    head_size = int(rng.choice([16, 32, 64, 128]))
    dtype_a = str(rng.choice(["bf16", "fp16", "fp32"]))
    prefill: dict[str, KVCacheLayout] = {}
    decode: dict[str, KVCacheLayout] = {}
    if kind == "mla":
        latent = int(rng.choice([64, 96, 576]))
        for side, (d, bs) in enumerate(((prefill, bs_p), (decode, bs_d))):
            d["kv"] = KVCacheLayout.mla(num_layers=layers, num_blocks=nb, block_size=bs, latent_dim=latent,
                                        cross_layer=cross[side])  # fmt: skip
    else:
        prefill["kv"], decode["kv"] = attn(0, p_tp, bs_p), attn(1, d_tp, bs_d)
    if kind == "hybrid":
        page = int(rng.choice([256, 1000, 4096]))
        mamba_layers = int(rng.integers(1, 3))
        for d in (prefill, decode):
            d["mamba"] = KVCacheLayout.mamba(num_layers=mamba_layers, num_blocks=64, page_size_bytes=page)
    lay = prefill["kv"]
    label = (
        f"#{idx} {kind} {lay.dtype} L{layers} {'' if kind == 'mla' else f'H{heads} '}hs{lay.head_size} "
        f"TP {p_tp}->{d_tp} bs {bs_p}->{bs_d} "
        f"{orders[0]}{'x' if cross[0] else ''}->{orders[1]}{'x' if cross[1] else ''}"
    )
    # Refuse a draw the topology cannot serve (should not happen; keeps the soak honest if it does).
    TransferTopology(decode["kv"], prefill["kv"], RankInfo(0, d_tp), p_tp)
    return Config(label, p_tp, d_tp, prefill, decode)


class Rank:
    """A sidecar and its in-process worker."""

    def __init__(self, sidecar: Sidecar, layouts: dict[str, KVCacheLayout], rank: RankInfo) -> None:
        self.sidecar = sidecar
        self.rank = rank
        self.layouts = layouts
        self.buffers = {g: SharedKVBuffer.create(lay) for g, lay in layouts.items()}
        self.client = AsyncClient(sidecar.local_target)

    async def close(self) -> None:
        await self.client.close()
        await self.sidecar.stop(0)
        for b in self.buffers.values():
            b.close()


async def run_config(
    cfg: Config, transfers: int, concurrency: int, rng: np.random.Generator, sock_dir: Path, mode: str = "pull",
    faults: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Start the sidecars of one configuration and run ``transfers`` verified transfers."""
    ranks: list[list[Rank]] = [[], []]
    for side, (tp, layouts, role) in enumerate(((cfg.prefill_tp, cfg.prefill, "prefill"),
                                                (cfg.decode_tp, cfg.decode, "decode"))):  # fmt: skip
        for r in range(tp):
            sc = Sidecar(load_settings({
                "engine_id": role, "role": role, "peer_listen": "127.0.0.1:0", "metrics_listen": "",
                "local_socket": str(sock_dir / f"{role}{r}.sock"), "log_level": "error", "lease_seconds": 120,
            }, env={}))  # fmt: skip
            await sc.start()
            rk = Rank(sc, layouts, RankInfo(r, tp))
            await rk.client.register_caches({g: (layouts[g], b.ref()) for g, b in rk.buffers.items()}, rank=rk.rank)
            ranks[side].append(rk)
    prefill, decode = ranks
    addresses = [p.sidecar.peer_address for p in prefill]
    kv_p, kv_d = cfg.prefill["kv"], cfg.decode["kv"]
    step = math.lcm(kv_p.block_size, kv_d.block_size)
    max_tokens = min(kv_p.num_blocks * kv_p.block_size, kv_d.num_blocks * kv_d.block_size) // (concurrency + 1)
    max_units = max(1, max_tokens // step)
    allocs = {
        (side, g): BlockAllocator(lay.num_blocks, rng)
        for side, layouts in ((0, cfg.prefill), (1, cfg.decode)) for g, lay in layouts.items()
    }  # fmt: skip
    stats: dict[str, Any] = {"label": cfg.label, "transfers": 0, "bytes": 0, "descriptors": 0, "failures": [],
                             "pushed": 0, "faults": 0}  # fmt: skip
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            tokens = int(rng.integers(1, max_units + 1)) * step
            p_blocks = {"kv": allocs[(0, "kv")].allocate(tokens // kv_p.block_size)}
            d_blocks = {"kv": allocs[(1, "kv")].allocate(tokens // kv_d.block_size)}
            if "mamba" in cfg.prefill:
                n = int(rng.integers(1, 3))
                p_blocks["mamba"] = allocs[(0, "mamba")].allocate(n)
                d_blocks["mamba"] = allocs[(1, "mamba")].allocate(n)
            rid, salt = f"soak-{i}", i + 1
            push = mode == "push" or (mode == "mixed" and bool(rng.integers(2)))
            fault = push and rng.random() < faults
            try:
                if fault:
                    await _push_fault(rid, salt, prefill, decode, addresses, p_blocks, d_blocks, rng, stats)
                    return
                if push:
                    for d in decode:
                        for g, ids in d_blocks.items():
                            poison_blocks(d.buffers[g], ids)
                    # Offered first, as a decode instance does; the publish comes while the offers wait.
                    pulls = [asyncio.ensure_future(d.client.pull(rid, addresses, d_blocks, push=True)) for d in decode]
                    await asyncio.sleep(float(rng.uniform(0, 0.002)))
                    await _publish(prefill, rid, p_blocks, salt)
                    results = await asyncio.gather(*pulls)
                    stats["pushed"] += 1
                else:
                    await _publish(prefill, rid, p_blocks, salt)
                    for d in decode:
                        for g, ids in d_blocks.items():
                            poison_blocks(d.buffers[g], ids)
                    results = await asyncio.gather(*(d.client.pull(rid, addresses, d_blocks) for d in decode))
                for d, res in zip(decode, results, strict=True):
                    checked = bad = 0
                    for g, ids in d_blocks.items():
                        c, b = verify_blocks(d.buffers[g], d.rank, ids, salt)
                        checked, bad = checked + c, bad + b
                    if bad:
                        stats["failures"].append(f"{rid} decode rank {d.rank.tp_rank}: {bad} of {checked} bytes differ")
                    stats["bytes"] += checked - bad
                    stats["descriptors"] += res.descriptors
                stats["transfers"] += 1
            except KvxferError as exc:
                stats["failures"].append(f"{rid}: {exc!r} (reason {getattr(exc, 'reason', '')})")
            finally:
                for (side, g), a in allocs.items():
                    a.release((p_blocks if side == 0 else d_blocks)[g])

    try:
        await asyncio.gather(*(one(i) for i in range(transfers)))
        # Every prefill rank's lease must be gone: confirmed by its readers or freed as an unread replica.
        for _ in range(200):
            leases = [int((await p.client.status())["leases"]) for p in prefill]
            if not any(leases):
                break
            await asyncio.sleep(0.01)
        if any(leases):
            stats["failures"].append(f"leases still held after all transfers: {leases}")
    finally:
        for side_ranks in ranks:
            for rk in side_ranks:
                await rk.close()
    return stats


async def _publish(prefill: list[Rank], rid: str, blocks: dict[str, Any], salt: int) -> None:
    for p in prefill:
        for g, ids in blocks.items():
            fill_blocks(p.buffers[g], p.rank, ids, salt)
        await p.client.publish(rid, blocks)


async def _push_fault(
    rid: str, salt: int, prefill: list[Rank], decode: list[Rank], addresses: list[str], p_blocks: dict[str, Any],
    d_blocks: dict[str, Any], rng: np.random.Generator, stats: dict[str, Any],
) -> None:  # fmt: skip
    """A push the decode side gives up on (abort mid-flight, or a prefill that never publishes)."""
    stats["faults"] += 1
    for d in decode:
        for g, ids in d_blocks.items():
            poison_blocks(d.buffers[g], ids)
    never = bool(rng.integers(2))
    deadline = 0.3 if never else 0.0
    pulls = [asyncio.ensure_future(d.client.pull(rid, addresses, d_blocks, push=True, deadline=deadline or None))
             for d in decode]  # fmt: skip
    publish = None if never else asyncio.ensure_future(_publish(prefill, rid, p_blocks, salt))
    if not never:
        await asyncio.sleep(float(rng.uniform(0, 0.01)))  # the WRITEs may be queued, in flight or done
        for d in decode:
            await d.client.abort(rid, "soak: the decode side gives up")
    outcomes = await asyncio.gather(*pulls, return_exceptions=True)
    if publish is not None:
        await publish
    want = "DEADLINE_EXCEEDED" if never else "ABORTED"
    landed = all(not isinstance(o, BaseException) for o in outcomes)
    for o in outcomes:
        if isinstance(o, BaseException) and not (isinstance(o, KvxferRpcError) and o.code.name == want):
            stats["failures"].append(f"{rid} ({'never published' if never else 'aborted'}): {o!r}")
    for p in prefill:  # an abort that reached a rank before its publish leaves it to its lease: free it
        with contextlib.suppress(KvxferError):
            await p.client.release(rid)
    if landed:  # the abort came after every WRITE had landed: the pull is done and its bytes complete
        for d in decode:
            for g, ids in d_blocks.items():
                _c, bad = verify_blocks(d.buffers[g], d.rank, ids, salt)
                if bad:
                    stats["failures"].append(f"{rid}: landed but {bad} bytes differ on decode rank {d.rank.tp_rank}")
        return
    for d in decode:  # given up: from now on nothing may land in these blocks
        for g, ids in d_blocks.items():
            poison_blocks(d.buffers[g], ids)
    await asyncio.sleep(FENCE_CHECK_S)  # a WRITE past the fence would land within this (loopback: microseconds)
    for d in decode:
        bad = [g for g, ids in d_blocks.items() if not still_poisoned(d.buffers[g], ids)]
        if bad:
            stats["failures"].append(f"{rid}: bytes landed in decode rank {d.rank.tp_rank}'s blocks of {bad} after "
                                     "the push was given up")  # fmt: skip
    return False


async def soak(
    transfers: int, configs: int, concurrency: int, seed: int, progress: bool, mode: str = "pull",
    faults: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Run the soak; returns the summary."""
    rng = np.random.default_rng(seed)
    per = [transfers // configs + (1 if i < transfers % configs else 0) for i in range(configs)]
    sock_dir = Path(tempfile.mkdtemp(prefix="kx-soak-"))
    t0 = time.perf_counter()
    results = []
    for i, n in enumerate(per):
        cfg = draw_config(rng, i)
        t = time.perf_counter()
        r = await run_config(cfg, n, concurrency, rng, sock_dir, mode, faults)
        r["seconds"] = time.perf_counter() - t
        results.append(r)
        if progress:
            print(f"{r['transfers']:5d} ok, {len(r['failures'])} failed, {r['seconds']:5.1f}s  {cfg.label}",
                  file=sys.stderr, flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    failures = [f for r in results for f in r["failures"]]
    return {
        "ok": not failures and sum(r["transfers"] + r["faults"] for r in results) == transfers,
        "transfers": sum(r["transfers"] for r in results),
        "requested": transfers,
        "verified_bytes": sum(r["bytes"] for r in results),
        "failures": len(failures),
        "first_failures": failures[:10],
        "configs": [
            {k: r[k] for k in ("label", "transfers", "bytes", "descriptors", "seconds", "pushed", "faults")}
            for r in results
        ],
        "mode": mode,
        "pushed": sum(r["pushed"] for r in results),
        "faults": sum(r["faults"] for r in results),
        "seconds": elapsed,
        "transfers_per_s": sum(r["transfers"] for r in results) / elapsed,
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transfers", type=int, default=10000)
    ap.add_argument("--configs", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("pull", "push", "mixed"), default="pull")
    ap.add_argument("--faults", type=float, default=0.0, help="share of push transfers given up on purpose")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import uvloop

    if not 0.0 <= a.faults <= 1.0:
        ap.error(f"--faults: must be in [0, 1], got {a.faults}")
    r = uvloop.run(soak(a.transfers, a.configs, a.concurrency, a.seed, progress=not a.json, mode=a.mode,
                        faults=a.faults))  # fmt: skip
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['transfers']} of {r['requested']} transfers ({r['mode']}: {r['pushed']} pushed, {r['faults']} "
              f"given up on purpose) over {len(r['configs'])} configurations, "
              f"{r['verified_bytes'] / 2**30:.2f} GiB verified, {r['failures']} failures, {r['seconds']:.0f}s "
              f"({r['transfers_per_s']:.0f}/s)")  # fmt: skip
        for f in r["first_failures"]:
            print(f"  FAILED {f}")
    # Skip interpreter teardown: native data-plane libraries may crash in exit-time destructors.
    sys.stdout.flush()
    os._exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
