"""``kvxfer demo``: two sidecars and two synthetic workers on loopback, a verified stream of requests.

The prefill worker(s) fill each request's blocks with checkable contents and publish them; the
decode worker(s) pull them through their sidecar (which READs over NIXL or Mooncake from the prefill
sidecars) and verify every byte. With ``--mode push`` the decode workers offer their blocks first
(as a decode instance does when the proxy sends it the request with the prefill's), and the
prefill sidecars WRITE into them once the request is published. Block lists are fragmented the
way a paged allocator leaves them. With different TP sizes every rank gets its own worker process
and sidecar, and each decode rank reads its heads from the prefill ranks that hold them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from kvxfer.cli_errors import EXIT_FAILURE, EXIT_USAGE, describe, report
from kvxfer.errors import KvxferError, Reason
from kvxfer.harness.cluster import BlockAllocator, ClusterError, LocalCluster
from kvxfer.layout import CacheKind, DType, KVCacheLayout, Order
from kvxfer.planning import ModelShape
from kvxfer.topology import RankInfo, TransferTopology

__all__ = ["DEFAULTS", "FLAGS", "DemoOptionError", "demo_main", "run_demo"]

DEFAULTS: dict[str, Any] = {
    "backend": "nixl",
    "mode": "pull",
    "prefill_tp": 1,
    "decode_tp": 1,
    "order": "HND",
    "kind": "attention",
    "layers": 32,
    "kv_heads": 8,
    "head_size": 128,
    "dtype": "bf16",
    "block_size": 16,
    "cross_layer": False,
    "num_blocks": 0,
    "requests": 32,
    "min_tokens": 128,
    "max_tokens": 1024,
    "memory_mib": 1024,
    "seed": 0,
    "progress": True,
}


def _layout(opts: dict[str, Any], tp: int, num_blocks: int) -> KVCacheLayout:
    kind = CacheKind(opts["kind"])
    shape = ModelShape(
        kind, opts["layers"], 1 if kind in (CacheKind.MLA, CacheKind.MAMBA) else opts["kv_heads"], opts["head_size"],
        DType.INT8 if kind is CacheKind.MAMBA else DType.parse(opts["dtype"]), Order(str(opts["order"]).upper()),
        opts["cross_layer"],
    )  # fmt: skip
    block_size = 1 if kind is CacheKind.MAMBA else int(opts["block_size"])
    return shape.layout(tp_size=tp, num_blocks=num_blocks, block_size=block_size)


class DemoOptionError(KvxferError):
    """A demo option the demo cannot run with; the message names the command-line flag."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


#: The flag of each option (and of the layout fields the core names in its errors).
FLAGS: dict[str, str] = {
    **{k: "--" + k.replace("_", "-") for k in DEFAULTS},
    "order": "--layout", "num_layers": "--layers", "total_kv_heads": "--kv-heads", "num_kv_heads": "--kv-heads",
}  # fmt: skip


def _check_options(opts: dict[str, Any]) -> None:
    """Refuse a bad option before any process starts; messages name the command-line flag."""
    choices = {
        "backend": ("--backend", ("nixl", "mooncake", "worker")),
        "mode": ("--mode", ("pull", "push")),
        "order": ("--layout", tuple(o.value for o in Order)),
        "kind": ("--kind", tuple(k.value for k in CacheKind)),
    }
    for key, (flag, allowed) in choices.items():
        value = str(opts[key]).upper() if key == "order" else str(opts[key])
        if value not in allowed:
            raise DemoOptionError(f"{flag}: must be one of {', '.join(allowed)}, got {opts[key]!r}", field=key)
    for key in ("prefill_tp", "decode_tp", "requests", "layers", "min_tokens", "max_tokens", "memory_mib"):
        if int(opts[key]) < 1:
            raise DemoOptionError(f"--{key.replace('_', '-')}: must be >= 1, got {opts[key]}", field=key)
    if int(opts["min_tokens"]) > int(opts["max_tokens"]):
        raise DemoOptionError(
            f"--min-tokens: {opts['min_tokens']} is more than --max-tokens {opts['max_tokens']}", field="min_tokens"
        )
    # The model's shape on each side, so that an error names that side's TP flag.
    for key in ("prefill_tp", "decode_tp"):
        try:
            _layout(opts, int(opts[key]), 1)
        except KvxferError as exc:
            flags = {**FLAGS, "tp_size": FLAGS[key]}
            side = f" ({FLAGS[key]} {opts[key]})" if exc.field in ("tp_size", "total_kv_heads", "num_kv_heads") else ""
            raise DemoOptionError(describe(exc, flags) + side, field=exc.field) from None


def run_demo(**options: Any) -> dict[str, Any]:
    """Run the demo and return its figures (see :data:`DEFAULTS` for the options).

    The result has at least ``requests``, ``verified_bytes``, ``mismatched_bytes``, ``gbps``,
    ``p50_ms``, ``p99_ms``, ``descriptors_per_request`` and ``ok``.
    """
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise DemoOptionError(f"demo: unknown options {sorted(unknown)}", field=sorted(unknown)[0])
    opts = {**DEFAULTS, **options}
    _check_options(opts)
    p_tp, d_tp, n_req = int(opts["prefill_tp"]), int(opts["decode_tp"]), int(opts["requests"])
    probe = _layout(opts, 1, 1)
    bs = probe.block_size
    per_block_side = probe.page_bytes * probe.num_layers  # one block, all ranks of one side (heads split)
    if probe.kind in (CacheKind.MLA, CacheKind.MAMBA):
        per_block_side *= max(p_tp, d_tp)  # replicated on every rank
    max_blocks = -(-int(opts["max_tokens"]) // bs)
    min_blocks = max(1, int(opts["min_tokens"]) // bs)
    need = 2 * max_blocks + 4
    num_blocks = int(opts["num_blocks"]) or max(need, min(512, int(opts["memory_mib"]) * 2**20 // per_block_side))
    if num_blocks < need:
        raise DemoOptionError(
            f"num_blocks: {num_blocks} cannot hold two requests of {max_blocks} blocks", field="num_blocks"
        )
    p_layout, d_layout = _layout(opts, p_tp, num_blocks), _layout(opts, d_tp, num_blocks)
    try:  # refuse impossible shapes before any process
        TransferTopology(d_layout, p_layout, RankInfo(0, d_tp), p_tp)
    except KvxferError as exc:
        raise DemoOptionError(describe(exc, {**FLAGS, "tp_size": "--prefill-tp"}), field=exc.field) from None
    rng = np.random.default_rng(int(opts["seed"]))
    show = bool(opts["progress"])
    t_start = time.perf_counter()
    with LocalCluster(backend=str(opts["backend"])) as cluster:
        pre = [cluster.start_sidecar(f"prefill-{q}", "prefill", "prefill") for q in range(p_tp)]
        dec = [cluster.start_sidecar(f"decode-{r}", "decode", "decode") for r in range(d_tp)]
        pw = [
            cluster.start_worker(f"prefill-w{q}", pre[q], {"kv": p_layout}, (q, p_tp), watch=True) for q in range(p_tp)
        ]
        dw = [cluster.start_worker(f"decode-w{r}", dec[r], {"kv": d_layout}, (r, d_tp)) for r in range(d_tp)]
        cluster.wait_workers()
        setup_s = time.perf_counter() - t_start
        addresses = [s.peer_address for s in pre]
        p_alloc, d_alloc = BlockAllocator(num_blocks, rng), BlockAllocator(num_blocks, rng)
        sizes = rng.integers(min_blocks, max_blocks + 1, size=n_req)
        per_request: list[dict[str, Any]] = []

        def prefill(i: int) -> tuple[str, Any]:
            rid = f"demo-{i}"
            blocks = p_alloc.allocate(int(sizes[i]))
            for w in pw:
                w.send("prefill", rid, {"kv": blocks}, 1000 + i, 0.0)
            return rid, blocks

        def collect(workers: list[Any]) -> list[Any]:
            try:
                return [w.recv() for w in workers]
            except ClusterError as exc:
                raise ClusterError(f"{exc}\n{cluster.logs()}") from None

        progress = _progress(show, n_req)
        t_run = time.perf_counter()
        push = opts["mode"] == "push"
        with progress:
            task = progress.add_task("transfers", total=n_req)
            pending = None if push else prefill(0)
            if not push:
                collect(pw)
            for i in range(n_req):
                d_blocks = d_alloc.allocate(int(sizes[i]))
                if push:
                    # The decode side offers first; the prefill publishes while the offers wait.
                    for w in dw:
                        w.send("pull", f"demo-{i}", addresses, {"kv": d_blocks}, 1000 + i, "prefill", None, True)
                    pending = prefill(i)
                    collect(pw)
                    nxt = None
                else:
                    assert pending is not None
                    for w in dw:
                        w.send("pull", pending[0], addresses, {"kv": d_blocks}, 1000 + i, "prefill")
                    nxt = prefill(i + 1) if i + 1 < n_req else None  # overlap the next prefill with this pull
                _, p_blocks = pending
                results = collect(dw)
                if nxt is not None:
                    collect(pw)
                p_alloc.release(p_blocks)
                d_alloc.release(d_blocks)
                plan = TransferTopology(d_layout, p_layout, RankInfo(0, d_tp), p_tp).plan(d_blocks, p_blocks)
                per_request.append({
                    "latency_s": max(r["latency_s"] for r in results),
                    "data_s": max(r["data_s"] for r in results),
                    "bytes": sum(r["bytes"] for r in results),
                    "checked": sum(r["checked"] for r in results),
                    "mismatched": sum(r["mismatched"] for r in results),
                    "descriptors": sum(r["descriptors"] for r in results),
                    "per_block_descriptors": plan.per_block_descriptors * d_tp,
                    "blocks": int(sizes[i]),
                    "warnings": sorted({w for r in results for w in r["warnings"]}),
                })  # fmt: skip
                if nxt is not None:
                    pending = nxt
                progress.update(task, advance=1)
        run_s = time.perf_counter() - t_run
        time.sleep(0.3)  # let the last release notices reach the prefill workers' streams
        codes = cluster.stop()
        released = sum(int(w.info.get("final", {}).get("RELEASED", 0)) for w in pw)
    return _summary(opts, per_request, p_layout, d_layout, num_blocks, released, codes, setup_s, run_s,
                    time.perf_counter() - t_start)  # fmt: skip


def _summary(
    opts: dict[str, Any], reqs: list[dict[str, Any]], p_layout: KVCacheLayout, d_layout: KVCacheLayout,
    num_blocks: int, released: int, codes: dict[str, int | None], setup_s: float, run_s: float, wall_s: float,
) -> dict[str, Any]:  # fmt: skip
    lat = np.array([r["latency_s"] for r in reqs]) * 1e3
    data = np.array([r["data_s"] for r in reqs])
    moved = sum(r["bytes"] for r in reqs)
    mismatched = sum(r["mismatched"] for r in reqs)
    expected_releases = len(reqs) * int(opts["prefill_tp"])
    clean_exit = all(c == 0 for c in codes.values())
    return {
        "ok": mismatched == 0 and released == expected_releases and clean_exit,
        "requests": len(reqs),
        "verified_bytes": sum(r["checked"] for r in reqs) - mismatched,
        "mismatched_bytes": mismatched,
        "moved_bytes": moved,
        "gbps": moved / max(float(lat.sum()) / 1e3, 1e-9) / 1e9,
        "data_gbps": moved / max(float(data.sum()), 1e-9) / 1e9,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "max_ms": float(lat.max()),
        "descriptors_per_request": float(np.mean([r["descriptors"] for r in reqs])),
        "per_block_descriptors_per_request": float(np.mean([r["per_block_descriptors"] for r in reqs])),
        "mean_request_mib": moved / len(reqs) / 2**20,
        "mean_request_blocks": float(np.mean([r["blocks"] for r in reqs])),
        "released": released,
        "sidecar_exit_codes": codes,
        "backend": opts["backend"],
        "mode": opts["mode"],
        "prefill_tp": opts["prefill_tp"],
        "decode_tp": opts["decode_tp"],
        "order": p_layout.order.value,
        "num_blocks": num_blocks,
        "prefill_layout": p_layout.to_dict(),
        "decode_layout": d_layout.to_dict(),
        "warnings": sorted({w for r in reqs for w in r["warnings"]}),
        "setup_s": setup_s,
        "run_s": run_s,
        "wall_s": wall_s,
    }


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *_a: Any, **_k: Any) -> int:
        return 0

    def update(self, *_a: Any, **_k: Any) -> None:
        return None


class _LineProgress(_NoProgress):
    """Progress as plain lines on stderr (a log or a CI job has no terminal to redraw a bar in)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0, self.shown = total, 0, time.perf_counter(), 0

    def update(self, *_a: Any, advance: int = 1, **_k: Any) -> None:
        self.done += advance
        tenth = self.done * 10 // self.total
        if tenth > self.shown or self.done == self.total:
            self.shown = tenth
            print(f"transfers: {self.done}/{self.total} ({time.perf_counter() - self.t0:.1f}s)", file=sys.stderr,
                  flush=True)  # fmt: skip


def _progress(show: bool, total: int) -> Any:
    if not show:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _LineProgress(total)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    )  # fmt: skip


def demo_main(as_json: bool = False, **options: Any) -> int:
    """Run the demo and print a table (or one JSON object); returns the exit code.

    0: every byte verified; 1: a byte differs or the demo failed while running; 2: a bad option
    (refused before anything starts). Errors are one ``error: ...`` line on stderr (and, with
    ``as_json``, ``{"ok": false, "error": ...}`` on stdout).
    """
    try:
        result = run_demo(progress=not as_json, **options)
    except KvxferError as exc:
        usage = isinstance(exc, DemoOptionError)
        text = exc.message if usage else f"demo failed: {exc.message}"
        if as_json:
            print(json.dumps({"ok": False, "error": text}))
        report(text)
        return EXIT_USAGE if usage else EXIT_FAILURE
    if as_json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0 if result["ok"] else 1


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    lay = r["prefill_layout"]
    out.print(
        f"[bold]kvxfer demo[/bold]: {r['backend']} {r['mode']}, prefill TP {r['prefill_tp']} -> decode TP "
        f"{r['decode_tp']}, "
        f"{lay['kind']} {lay['dtype']} {r['order']}, {lay['num_layers']} layers x {lay['total_kv_heads']} kv heads x "
        f"{lay['head_size']}, block {lay['block_size']}, {r['num_blocks']} blocks per rank"
    )
    t = Table(show_header=False)
    t.add_row("requests", str(r["requests"]))
    t.add_row("verified bytes", f"{r['verified_bytes']:,} ({r['verified_bytes'] / 2**30:.2f} GiB)")
    t.add_row("mismatched bytes", f"[{'green' if r['mismatched_bytes'] == 0 else 'red'}]{r['mismatched_bytes']:,}")
    t.add_row(f"throughput ({r['mode']}, end to end)", f"{r['gbps']:.2f} GB/s")
    t.add_row("throughput (data plane only)", f"{r['data_gbps']:.2f} GB/s")
    t.add_row(f"{r['mode']} latency p50 / p99 / max", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} / {r['max_ms']:.1f} ms")
    t.add_row("mean request", f"{r['mean_request_blocks']:.0f} blocks, {r['mean_request_mib']:.1f} MiB")
    t.add_row(
        "descriptors per request",
        f"{r['descriptors_per_request']:.1f} (one per block per layer: {r['per_block_descriptors_per_request']:.0f})",
    )
    t.add_row("blocks released on the prefill side", f"{r['released']}")
    t.add_row("time (setup / transfers / total)", f"{r['setup_s']:.1f} / {r['run_s']:.1f} / {r['wall_s']:.1f} s")
    out.print(t)
    for w in r["warnings"]:
        out.print(f"[yellow]note:[/yellow] {w}")
    out.print("[green]every byte verified[/green]" if r["ok"] else "[red]FAILED[/red]")
