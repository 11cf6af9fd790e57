#!/usr/bin/env python3
"""Baseline for issue 14: two NIXL agents that own their KV caches, READ with three descriptor schemes.

What vLLM's NixlConnector does on one host: every worker process owns a NIXL agent that registers
its own KV tensors, and the decode side READs the prefill side's blocks. Here both agents live in
this one process (UCX between them: cuda_ipc on a GPU with ``CUDA_IPC_ENABLE_SAME_PROCESS``, which
kvxfer's UCX ``engine_config`` sets), each with a cache it allocated itself: a torch tensor on
``cuda:<device>`` registered as VRAM, or a torch CPU tensor registered as DRAM (``--memory dram``,
which runs the same code here without a GPU). The agents are made by kvxfer's own
``nixl_agent._make_agent`` (cuInit first, ``UCX_MEMTYPE_CACHE=n``, backend UCX with
``CUDA_IPC_ENABLE_GET_ZCOPY=y``, progress-thread delay as the sidecar's), so the only difference
from the sidecar's NIXL path is who owns the memory.

Cache: Llama-3-8B's (32 layers, 8 KV heads, head 128, bf16, block 16, HND: K and V of a block in
one 64 KiB page per layer), 4096 blocks per side (8 GiB) by default; ``--layout smoke`` is
``sidecar_vram_bench``'s small layout. Block lists: the same as ``sidecar_vram_bench.py`` for the
same seed, blocks, sizes, reps and ``--max-run`` (``BlockAllocator`` lists with runs of 1 to
``--max-run`` free blocks, drawn independently for both sides, one pair per pull, warm-up first; then
the "contiguous" lists), so a row here and the sidecar's row for the same request moved the same
blocks. Each pull READs the prefill blocks into the decode blocks with descriptors built so:

* ``kvxfer coalesced``: ``TransferTopology.plan(...).per_rank[0].descriptors(...)``, exactly what
  the sidecar's pull builds (``kvxfer/server/pull_descriptors.py``), posted with ``initialize_xfer`` as
  ``kvxfer/transport/nixl_backend.py`` does;
* ``per block+layer, NIXL merge``: one descriptor per block per layer (the page holds K and V),
  from prepared descriptor lists of every page of each side (``prep_xfer_dlist`` once,
  ``make_prepped_xfer`` with page indices per pull): how NixlConnector addresses a blocks-first
  cache. NIXL 1.5.1 merges neighbours of a prepared transfer that are contiguous on both sides
  inside one registered region, so what it posts ("posted" in the table, worked out by
  :func:`nixl_merged`) is as few as kvxfer's coalesced descriptors for these layouts;
* ``per block+layer, no merge``: the same with ``skip_desc_merge=True``: one descriptor per block
  per layer reaches UCX.

Times (median of ``--reps`` pulls after one warm-up pull per case, the schemes taking turns):
``data`` = descriptor arrays handed to NIXL (``get_xfer_descs`` + ``initialize_xfer``, or
``make_prepped_xfer``) -> posted -> DONE, what the sidecar's data-plane time covers; ``post->done``
= ``transfer()`` -> DONE (busy polling ``check_xfer_state``); ``build`` = making the descriptor
arrays (topology plan, or the page indices), not in ``data``. Every pull is verified byte for byte
(every 8-byte word of the source cache is unique to its layer, block and offset; the destination
is 0xFF before each pull, compared after and its blocks set back to 0xFF, on the device when it is a GPU; bytes
outside the destination blocks are checked to have stayed 0xFF). GB/s are also given as a fraction
of a device copy measured in the same run (``sidecar_vram_bench.copy_rate``).

  python3 bench/gpu/nixl_agents_bench.py --out $OUT                                   # GPU 0, defaults
  .venv/bin/python bench/gpu/nixl_agents_bench.py --memory dram --blocks 512 --sizes 128,1024   # here
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_MODULES", "^efa")  # see tests/transport/conftest.py: a crash at exit otherwise
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kvxfer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # for sidecar_vram_bench

import numpy as np
from sidecar_vram_bench import copy_rate, llama3_8b, proto_lines, smoke_layout

COALESCED = "kvxfer coalesced"
PREPPED = "per block+layer, NIXL merge"
UNMERGED = "per block+layer, no merge"
METHODS = (COALESCED, PREPPED, UNMERGED)
POISON = 0xFF
OFFSET_BITS = 20  # a word's value: (layer * num_blocks + block) << 20 | word index in the page


def list_kinds(layout: Any, max_run: int) -> list[tuple[int, str]]:
    """(longest run, label) of each kind of block list, in ``sidecar_vram_bench``'s order and words."""
    return [(max_run, f"fragmented (runs 1..{max_run})"), (layout.num_blocks, "contiguous")]


def block_lists(
    layout: Any, sizes: list[int], reps: int, max_run: int, seed: int
) -> dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]]:
    """(prefill ids, decode ids) of every pull, warm-up first, drawn as ``sidecar_vram_bench`` draws them.

    One generator for the whole run; per (list kind, size): the warm-up pull and ``reps`` pulls, each
    a fresh ``BlockAllocator`` per side (prefill's list drawn first).
    """
    from kvxfer.harness.cluster import BlockAllocator

    rng = np.random.default_rng(seed)
    out: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for run, label in list_kinds(layout, max_run):
        for tokens in sizes:
            blocks = -(-tokens // layout.block_size)
            pairs = []
            for _ in range(1 + reps):
                p_alloc = BlockAllocator(layout.num_blocks, rng, run)
                d_alloc = BlockAllocator(layout.num_blocks, rng, run)
                pairs.append((p_alloc.allocate(blocks), d_alloc.allocate(blocks)))
            out[(label, tokens)] = pairs
    return out


def coalesced_descriptors(topo: Any, dst: Cache, src: Cache, d_ids: np.ndarray, p_ids: np.ndarray) -> tuple[Any, Any]:
    """The sidecar's descriptors for a pull of ``p_ids`` (remote) into ``d_ids`` (local): (N, 3) uint64 each."""
    (rp,) = topo.plan(d_ids, p_ids).per_rank
    return rp.descriptors(dst.table, src.table)


def nixl_merged(layout: Any, d_ids: np.ndarray, p_ids: np.ndarray) -> int:
    """Descriptors ``make_prepped_xfer`` posts for the page indices of these lists.

    NIXL (1.5.1) merges neighbouring descriptors of a prepared transfer that are contiguous on both
    sides inside one registered region (a layer here) unless ``skip_desc_merge``; ``initialize_xfer``
    does not merge (both seen through ``get_xfer_telemetry().descCount`` on DRAM).
    """
    joins = int(np.count_nonzero((np.diff(d_ids) == 1) & (np.diff(p_ids) == 1)))
    return int(layout.num_layers * (np.asarray(d_ids).size - joins))


def page_indices(layout: Any, ids: np.ndarray) -> np.ndarray:
    """Indices into a side's prepared list of pages (layer-major: layer * num_blocks + block), int32."""
    layers = np.arange(layout.num_layers, dtype=np.int64)[:, None] * layout.num_blocks
    return (layers + np.asarray(ids, dtype=np.int64)[None, :]).ravel().astype(np.int32)


class Cache:
    """One side's KV cache: a torch uint8 tensor holding the layout's regions (layers) back to back."""

    def __init__(self, layout: Any, memory: str, device: int) -> None:
        import torch

        from kvxfer.topology import RegionTable

        if layout.num_regions != layout.num_layers or layout.region_bytes != layout.num_blocks * layout.page_bytes:
            raise ValueError("the bench needs one region per layer holding that layer's pages back to back")
        if layout.page_bytes % 8 or layout.page_bytes // 8 >= 1 << OFFSET_BITS:
            raise ValueError(f"page of {layout.page_bytes} bytes: the pattern needs a multiple of 8 below 8 MiB")
        self.layout = layout
        self.vram = memory == "vram"
        self.device = device if self.vram else 0
        dev = torch.device(f"cuda:{device}") if self.vram else torch.device("cpu")
        self.tensor = torch.empty(layout.total_bytes, dtype=torch.uint8, device=dev)  # the only difference
        self.pages = self.tensor.view(layout.num_layers, layout.num_blocks, layout.page_bytes)
        base = self.tensor.data_ptr()
        self.table = RegionTable.for_layout(
            layout, [base + i * layout.region_bytes for i in range(layout.num_regions)], self.device
        )
        self.mem_type = "VRAM" if self.vram else "DRAM"

    def reg_descs(self) -> np.ndarray:
        """One (address, length, device) row per region, as the sidecar registers a table."""
        t = self.table
        return np.stack([t.base, t.size, t.device], axis=1).astype(np.uint64)

    def page_descs(self) -> np.ndarray:
        """One (address, length, device) row per page of every layer, layer-major."""
        lay = self.layout
        addr = self.table.base[:, None] + np.arange(lay.num_blocks, dtype=np.uint64)[None, :] * np.uint64(
            lay.page_bytes
        )
        n = addr.size
        return np.stack(
            [addr.ravel(), np.full(n, lay.page_bytes, np.uint64), np.full(n, self.device, np.uint64)], axis=1
        )

    def sync(self) -> None:
        """Wait for torch's work on this cache (UCX copies on its own streams)."""
        if self.vram:
            import torch

            torch.cuda.synchronize(self.device)

    def fill_pattern(self) -> None:
        """Every 8-byte word unique: (layer * num_blocks + block) << 20 | word index."""
        import torch

        lay = self.layout
        words = self.pages.view(torch.int64)  # (layers, blocks, page_bytes // 8)
        dev = self.tensor.device
        idx = torch.arange(words.shape[2], dtype=torch.int64, device=dev)[None, :]
        blocks = torch.arange(lay.num_blocks, dtype=torch.int64, device=dev)[:, None]
        for layer in range(lay.num_layers):
            words[layer] = ((blocks + layer * lay.num_blocks) << OFFSET_BITS) | idx
        self.sync()

    def poison(self, ids: np.ndarray | None = None) -> None:
        """0xFF over the given blocks of every layer (all of the cache without ``ids``)."""
        import torch

        if ids is None:
            self.tensor.fill_(POISON)
        else:
            self.pages.index_fill_(1, torch.as_tensor(ids, device=self.tensor.device), POISON)
        self.sync()

    def mismatched(self, ids: np.ndarray, src: Cache, src_ids: np.ndarray) -> int:
        """Bytes of our ``ids`` blocks that differ from ``src``'s ``src_ids`` blocks (all layers)."""
        import torch

        mine = torch.as_tensor(ids, device=self.tensor.device)
        theirs = torch.as_tensor(src_ids, device=src.tensor.device)
        bad = 0
        for layer in range(self.layout.num_layers):
            a = self.pages[layer].index_select(0, mine)
            b = src.pages[layer].index_select(0, theirs).to(a.device)
            bad += int(torch.count_nonzero(a != b).item())
        return bad

    def stray(self) -> int:
        """Bytes that are not poison (after the blocks of a case were poisoned again: stray writes)."""
        import torch

        return sum(
            int(torch.count_nonzero(self.pages[layer] != POISON).item()) for layer in range(self.layout.num_layers)
        )


@contextlib.contextmanager
def captured_output(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 into ``path`` (UCX prints its protocol tables there, through C stdio)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            libc.fflush(None)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class Agents:
    """Two NIXL agents of this process: ``src`` owns the prefill cache, ``dst`` the decode cache and READs."""

    def __init__(self, src: Cache, dst: Cache, facts: dict[str, Any]) -> None:
        from kvxfer import cuda_ipc
        from kvxfer.transport.base import TransportConfig
        from kvxfer.transport.nixl_agent import _make_agent, ucx_engine_config

        if dst.vram or src.vram:
            facts["cuda_init"] = cuda_ipc.try_init()  # UCX sees the GPUs only after cuInit
        # As vLLM's connector makes them: every call from one thread (NIXL's default sync mode).
        config = TransportConfig(nixl_thread_post_bytes=0)
        t0 = time.perf_counter()
        self.src_agent, _ = _make_agent("nixlab-prefill", config)
        self.dst_agent, _ = _make_agent("nixlab-decode", config)
        facts["agents_s"] = time.perf_counter() - t0
        facts["ucx_engine_config"] = ucx_engine_config()
        facts["progress_delay_us"] = config.nixl_progress_delay_us
        self.src, self.dst = src, dst
        t0 = time.perf_counter()
        self.src_reg = self.src_agent.register_memory(src.reg_descs(), src.mem_type)
        self.dst_reg = self.dst_agent.register_memory(dst.reg_descs(), dst.mem_type)
        facts["register_s"] = time.perf_counter() - t0
        # What a handshake does: each side loads the other's metadata (the reader needs the owner's).
        peer = self.dst_agent.add_remote_agent(self.src_agent.get_agent_metadata())
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.src_agent.add_remote_agent(self.dst_agent.get_agent_metadata())
        # NixlConnector's way: every page of each side prepared once, pulls pick pages by index.
        t0 = time.perf_counter()
        self.local_pages = self.dst_agent.prep_xfer_dlist("NIXL_INIT_AGENT", dst.page_descs(), dst.mem_type)
        self.remote_pages = self.dst_agent.prep_xfer_dlist(self.peer, src.page_descs(), src.mem_type)
        facts["prep_dlist_s"] = time.perf_counter() - t0
        facts["prepared_pages_per_side"] = int(dst.layout.num_layers * dst.layout.num_blocks)

    def read(self, method: str, local: Any, remote: Any, timeout: float = 60.0) -> tuple[float, float]:
        """One READ; returns (data seconds, post->done seconds). ``local``/``remote``: descriptors or indices."""
        agent = self.dst_agent
        t0 = time.perf_counter()
        if method == COALESCED:
            ld = agent.get_xfer_descs(local, self.dst.mem_type)
            rd = agent.get_xfer_descs(remote, self.src.mem_type)
            handle = agent.initialize_xfer("READ", ld, rd, self.peer, b"")
        else:
            handle = agent.make_prepped_xfer("READ", self.local_pages, local, self.remote_pages, remote, b"",
                                             skip_desc_merge=method == UNMERGED)  # fmt: skip
        try:
            t1 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                if time.perf_counter() - t1 > timeout:
                    raise TimeoutError(f"{method}: READ not done after {timeout:.0f} s")
            t2 = time.perf_counter()
            if state != "DONE":
                raise RuntimeError(f"{method}: READ ended in state {state}")
        finally:
            agent.release_xfer_handle(handle)
        return t2 - t0, t2 - t1

    def close(self) -> None:
        steps = (
            lambda: self.dst_agent.release_dlist_handle(self.local_pages),
            lambda: self.dst_agent.release_dlist_handle(self.remote_pages),
            lambda: self.dst_agent.remove_remote_agent(self.peer),
            lambda: self.src_agent.remove_remote_agent("nixlab-decode"),
            lambda: self.dst_agent.deregister_memory(self.dst_reg),
            lambda: self.src_agent.deregister_memory(self.src_reg),
        )
        for step in steps:
            with contextlib.suppress(Exception):
                step()


def bench_agents(
    layout: Any, *, memory: str, devices: tuple[int, int] = (0, 0), sizes: list[int], reps: int, max_run: int,
    seed: int = 0, copy_gbps: float | None = None, budget_s: float = 110.0, proto_info: bool = True,
    log_dir: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Rows for every (list kind, size, scheme); ``devices``: (prefill GPU, decode GPU) for VRAM.

    Returns {"ok", "facts", "rows", "wall_s", "stopped_early"}; rows carry ``sidecar_vram_bench``'s keys.
    """
    from kvxfer.topology import RankInfo, TransferTopology

    t_start = time.perf_counter()
    facts: dict[str, Any] = {"layout": layout.to_dict(), "page_bytes": layout.page_bytes, "memory": memory,
                             "devices": list(devices) if memory == "vram" else None}  # fmt: skip
    if copy_gbps is None:
        vram = memory == "vram"
        copy_gbps = copy_rate(1 << 30 if vram else 64 << 20, *(devices if vram else (None, None)))
    facts["copy_GBps"] = copy_gbps
    lists = block_lists(layout, sizes, reps, max_run, seed)
    src = Cache(layout, memory, devices[0])
    dst = Cache(layout, memory, devices[1])
    t0 = time.perf_counter()
    src.fill_pattern()
    dst.poison()
    facts["fill_s"] = time.perf_counter() - t0
    # Same engine settings as the sidecar; UCX_PROTO_INFO tables go to a log, not stdout.
    log = Path(log_dir or tempfile.mkdtemp(prefix="kvx-nixlab-")) / "nixl_agents_ucx.log"
    log.write_text("")  # this run's lines only
    saved_proto = os.environ.get("UCX_PROTO_INFO")
    if proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    else:
        os.environ.pop("UCX_PROTO_INFO", None)
    rows: list[dict[str, Any]] = []
    agents = None
    stopped = False
    try:
        with captured_output(log):
            agents = Agents(src, dst, facts)
        topo = TransferTopology(layout, layout, RankInfo(0, 1), 1)  # as kvxfer/server/topologies.py makes it
        facts["setup_s"] = time.perf_counter() - t_start
        print(f"[nixl-agents] {memory} set up in {facts['setup_s']:.1f} s (register {facts['register_s']:.2f} s, "
              f"prep dlists {facts['prep_dlist_s']:.2f} s)", flush=True)  # fmt: skip
        first = True
        for _, label in list_kinds(layout, max_run):
            for tokens in sizes:
                pairs = lists[(label, tokens)]
                ctx = captured_output(log) if first else contextlib.nullcontext()
                with ctx:  # the first pulls choose UCX's protocols: their tables go to the log
                    t0 = time.perf_counter()
                    got = run_case(agents, topo, src, dst, pairs, t_start + budget_s)
                    if first:
                        facts["first_case_s"] = time.perf_counter() - t0
                first = False
                for method in METHODS:
                    row = make_row(method, label, tokens, got[method], layout, copy_gbps)
                    rows.append(row)
                    print(row_line(row), flush=True)
                if time.perf_counter() - t_start > budget_s:
                    print(f"[nixl-agents] budget of {budget_s:.0f} s reached; stopping", flush=True)
                    stopped = True
                    break
            if stopped:
                break
    except Exception:  # keep the rows measured so far (a device run is too dear to lose them)
        facts["error"] = traceback.format_exc()
        print(f"[nixl-agents] failed:\n{facts['error']}", flush=True)
    finally:
        if agents is not None:
            agents.close()
        if saved_proto is None:
            os.environ.pop("UCX_PROTO_INFO", None)
        else:
            os.environ["UCX_PROTO_INFO"] = saved_proto
    facts["ucx_read_protocol"] = proto_lines(log)
    slow = [r for r in rows if r["MiB"] >= 128 and r["data_GBps"] < 5.0]
    if memory == "vram" and slow:  # cuda_ipc not chosen: UCX's "software emulation" over tcp reads at ~0.5 GB/s
        facts["slow_read_warning"] = f"{len(slow)} rows of >= 128 MiB under 5 GB/s: see ucx_read_protocol, {log}"
        print(f"[nixl-agents] WARNING: {facts['slow_read_warning']}", flush=True)
    facts["ucx_log"] = str(log)
    clean = all(r["mismatched_bytes"] == 0 and r["stray_bytes"] == 0 and r["verified_bytes"] > 0 for r in rows)
    ok = "error" not in facts and bool(rows) and clean
    return {"ok": ok, "facts": facts, "rows": rows, "wall_s": time.perf_counter() - t_start, "stopped_early": stopped}


def run_case(
    agents: Agents, topo: Any, src: Cache, dst: Cache, pairs: list[tuple[np.ndarray, np.ndarray]], deadline: float
) -> Any:
    """The warm-up pull then the timed pulls, the schemes on each pair in turn, every pull verified.

    Past ``deadline`` (``time.perf_counter()``) no further pair starts once one timed pull is in.
    """
    layout = src.layout
    got: dict[str, dict[str, list[Any]]] = {
        m: {k: [] for k in ("data", "post", "build", "descriptors", "posted", "verified", "bad")} for m in METHODS
    }
    for i, (p_ids, d_ids) in enumerate(pairs):
        if i >= 2 and time.perf_counter() > deadline:
            break
        for method in METHODS[i % 3 :] + METHODS[: i % 3]:  # the schemes take turns, in rotating order
            t0 = time.perf_counter()
            if method == COALESCED:
                local, remote = coalesced_descriptors(topo, dst, src, d_ids, p_ids)
                n = posted = int(local.shape[0])
            else:
                local, remote = page_indices(layout, d_ids), page_indices(layout, p_ids)
                n = int(local.size)
                posted = nixl_merged(layout, d_ids, p_ids) if method == PREPPED else n
            build = time.perf_counter() - t0
            data, post = agents.read(method, local, remote)
            bad = dst.mismatched(d_ids, src, p_ids)
            dst.poison(d_ids)
            rec = got[method]
            rec["verified"].append(d_ids.size * layout.num_layers * layout.page_bytes - bad)  # warm-up included
            rec["bad"].append(bad)
            if i == 0:
                continue  # the warm-up: connection set-up, UCX's protocol selection; not timed
            rec["data"].append(data)
            rec["post"].append(post)
            rec["build"].append(build)
            rec["descriptors"].append(n)
            rec["posted"].append(posted)
    stray = dst.stray()
    for method in METHODS:
        got[method]["stray"] = [stray]
    return got


def make_row(method: str, label: str, tokens: int, rec: dict[str, list[Any]], layout: Any, copy: float) -> dict:
    blocks = -(-tokens // layout.block_size)
    nbytes = blocks * layout.num_layers * layout.page_bytes
    data = statistics.median(rec["data"])
    post = statistics.median(rec["post"])
    build = statistics.median(rec["build"])
    row = {
        "path": f"nixl-agents {method}", "blocks": label, "tokens": tokens, "MiB": nbytes / 2**20,
        "descriptors": statistics.median(rec["descriptors"]), "descriptors_each": rec["descriptors"],
        "posted_descriptors": statistics.median(rec["posted"]),
        "data_GBps": nbytes / data / 1e9, "best_data_GBps": nbytes / min(rec["data"]) / 1e9,
        "post_GBps": nbytes / post / 1e9, "e2e_GBps": nbytes / (build + data) / 1e9,
        "data_ms": data * 1e3, "post_ms": post * 1e3, "build_ms": build * 1e3, "latency_ms": (build + data) * 1e3,
        "data_ms_each": [t * 1e3 for t in rec["data"]],
        "verified_bytes": sum(rec["verified"]), "mismatched_bytes": sum(rec["bad"]),
        "stray_bytes": sum(rec["stray"]), "reps": len(rec["data"]),
    }  # fmt: skip
    row["data_vs_copy"] = row["data_GBps"] / copy
    row["e2e_vs_copy"] = row["e2e_GBps"] / copy
    return row


def row_line(row: dict[str, Any]) -> str:
    return (
        f"[{row['path']}] {row['blocks']:26} {row['tokens']:6} tok {row['MiB']:6.0f} MiB {row['descriptors']:6.0f} desc"
        f"  data {row['data_GBps']:7.1f} GB/s ({row['data_vs_copy']:.3f} of copy, {row['data_ms']:.2f} ms)"
        f"  post->done {row['post_ms']:.2f} ms  build {row['build_ms']:.2f} ms"
        f"  verified {row['verified_bytes']:,} B, bad {row['mismatched_bytes']}, stray {row['stray_bytes']}"
    )


def markdown(result: dict[str, Any]) -> str:
    """The rows as a markdown table, with kvxfer's speed-up over one descriptor per block per layer."""
    facts = result.get("facts", {})
    lines = [
        f"NIXL agents owning their memory ({facts.get('memory')}), device copy {facts.get('copy_GBps', 0):.1f} GB/s",
        "",
        "| scheme | blocks | tokens | MiB | descriptors (posted) | data GB/s | of copy | data ms | post->done ms "
        "| build ms | verified B | bad |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = result.get("rows", [])
    for r in rows:
        lines.append(
            f"| {r['path'].removeprefix('nixl-agents ')} | {r['blocks']} | {r['tokens']} | {r['MiB']:.0f} "
            f"| {r['descriptors']:.0f} ({r['posted_descriptors']:.0f}) | {r['data_GBps']:.2f} "
            f"| {r['data_vs_copy']:.3f} | {r['data_ms']:.2f} "
            f"| {r['post_ms']:.2f} | {r['build_ms']:.2f} | {r['verified_bytes']:,} "
            f"| {r['mismatched_bytes'] + r['stray_bytes']} |"
        )
    by_case = {(r["blocks"], r["tokens"], r["path"].removeprefix("nixl-agents ")): r for r in rows}
    ratios = []
    for (blocks, tokens, method), r in by_case.items():
        others = [by_case.get((blocks, tokens, m)) for m in (PREPPED, UNMERGED)]
        if method == COALESCED and all(others):
            x = " / ".join(f"{r['data_GBps'] / o['data_GBps']:.2f}x" for o in others if o)
            ratios.append(f"{blocks}, {tokens} tok: {x}")
    if ratios:
        lines += ["", "kvxfer coalesced vs per block+layer with / without NIXL's merge (data GB/s):", "",
                  *(f"- {x}" for x in ratios)]  # fmt: skip
    proto = facts.get("ucx_read_protocol") or ["(none captured)"]
    lines += ["", "UCX READ protocol (agents):", "", *(f"    {ln}" for ln in proto)]
    for key in ("slow_read_warning", "error"):
        if facts.get(key):
            lines += ["", f"{key}: {facts[key]}"]
    return "\n".join(lines)


def comparison(rows: list[dict[str, Any]]) -> str:
    """Sidecar rows and these rows of one run side by side: data GB/s (fraction of the copy) per request."""
    paths = list(dict.fromkeys(r["path"] for r in rows))
    sidecar = [p for p in paths if not p.startswith("nixl-agents ")]
    agents = [p for p in paths if p.startswith("nixl-agents ")]
    cell = {(r["blocks"], r["tokens"], r["path"]): r for r in rows}
    cases = list(dict.fromkeys((r["blocks"], r["tokens"]) for r in rows))
    head = [
        "blocks",
        "tokens",
        *(f"sidecar {p}" for p in sidecar),
        *(p.replace("nixl-agents ", "agents: ") for p in agents),
    ]
    if agents:  # one verdict column per kvxfer path
        head += [f"{p} >= every agents row" for p in sidecar]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for blocks, tokens in cases:
        vals = [cell.get((blocks, tokens, p)) for p in sidecar + agents]
        out = [blocks, str(tokens)]
        out += [f"{r['data_GBps']:.2f} ({r['data_vs_copy']:.3f})" if r else "-" for r in vals]
        others = [r for r in vals[len(sidecar) :] if r]
        for mine in vals[: len(sidecar)] if agents else []:
            if mine and others:
                out.append("yes" if all(mine["data_GBps"] >= r["data_GBps"] for r in others) else "no")
            else:
                out.append("-")
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvxfer-nixl-agents"))
    ap.add_argument("--memory", choices=("vram", "dram"), default="vram")
    ap.add_argument("--cpu-smoke", action="store_true", help="--memory dram with the small layout, 256 blocks")
    ap.add_argument("--device", type=int, default=0, help="GPU of both caches (VRAM)")
    ap.add_argument("--layout", choices=("llama3-8b", "smoke"), default="llama3-8b")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per side (default 4096 = 8 GiB; smoke 256)")
    ap.add_argument("--sizes", default="", help="request sizes in tokens (default 128,1024,8192,16384; smoke 128,1024)")
    ap.add_argument("--reps", type=int, default=4, help="timed pulls per case, after one warm-up")
    ap.add_argument("--max-run", type=int, default=64, help="longest run of contiguous blocks in a fragmented list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop after the case that passes this")
    ap.add_argument("--no-proto-info", dest="proto_info", action="store_false")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.memory, args.layout = "dram", "smoke"
    args.blocks = args.blocks or (256 if args.cpu_smoke else 4096)
    default_sizes = "128,1024" if args.cpu_smoke else "128,1024,8192,16384"
    args.sizes = [int(x) for x in (args.sizes or default_sizes).split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layout = (smoke_layout if args.layout == "smoke" else llama3_8b)(args.blocks)
    try:
        result = bench_agents(layout, memory=args.memory, devices=(args.device, args.device), sizes=args.sizes,
                              reps=args.reps, max_run=args.max_run, seed=args.seed, budget_s=args.budget_s,
                              proto_info=args.proto_info, log_dir=out)  # fmt: skip
    except Exception:
        result = {"ok": False, "error": traceback.format_exc(), "rows": []}
        print(result["error"], flush=True)
    (out / "nixl_agents_bench.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out / "nixl_agents_bench.md").write_text(table + "\n")
    print(table)
    print(
        json.dumps({"ok": result["ok"], "wall_s": result.get("wall_s"), "stopped_early": result.get("stopped_early")})
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
