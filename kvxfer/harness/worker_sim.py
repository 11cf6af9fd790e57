"""A synthetic inference worker: KV memory in shared memory, a sidecar client, checkable contents.

The content of a request's KV cache is a function of *logical* coordinates only - layer, plane
(K|V, K, V, nvfp4 data or scales...), token position in the request, global KV head and word
within the row (a Mamba state split in TP segments: the byte's place in the whole state) - and a
per-request salt. Any rank of any TP size, block size or physical order
(any of vLLM's six, padded pages, kernel blocks) can therefore write its share
(:func:`fill_blocks`) or check what it received (:func:`verify_blocks`) without knowing the other
side: a decode rank that got every byte from the right place of the right prefill rank sees
exactly the expected values, and anything misplaced, stale or missing shows up as mismatches.

:func:`worker_main` (``python -m kvxfer.harness.worker_sim``) runs a worker process driven by JSON lines
on stdin (the demo and the soak script use it): it creates its shared-memory cache, registers it
with its sidecar, then prefills-and-publishes or pulls-and-verifies on command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from kvxfer.client import TokenSpan
from kvxfer.layout import CacheKind, KVCacheLayout, Plane, head_range
from kvxfer.topology import RankInfo
from kvxfer.wire import common_pb2, local_pb2

__all__ = ["CudaKVBuffer", "WorkerConfig", "fill_blocks", "global_heads", "verify_blocks", "worker_main"]

I64 = npt.NDArray[np.int64]
POISON = 0xA5  # what a decode rank writes into its destination blocks before a pull


def global_heads(layout: KVCacheLayout, rank: RankInfo) -> I64:
    """Global index of each local head; for an opaque Mamba page the rank itself (its page is its own
    state), 0 for a Mamba state split in TP segments or replicated (one state, see :func:`_state_bytes`)."""
    if layout.kind is CacheKind.MLA or layout.segments or layout.replicated:
        return np.zeros(1, dtype=np.int64)
    if layout.kind is CacheKind.MAMBA:
        return np.array([rank.tp_rank], dtype=np.int64)
    h0, _ = head_range(layout.total_kv_heads, rank.tp_size, rank.tp_rank)
    return h0 + np.arange(layout.num_kv_heads, dtype=np.int64)


def _word(layout: KVCacheLayout, row_bytes: int) -> type[np.unsignedinteger[Any]]:
    # A Mamba state split in TP segments is addressed byte by byte (a rank's slice need not be whole words).
    return np.uint32 if row_bytes % 4 == 0 and not layout.segments else np.uint8


def _state_bytes(layout: KVCacheLayout, rank: RankInfo) -> npt.NDArray[np.uint64]:
    """A Mamba page split in TP segments: the index of each of its bytes in the whole (global) state."""
    out, start = [], 0
    for size in layout.segments:
        out.append(start + rank.tp_rank * size + np.arange(size, dtype=np.uint64))
        start += size * rank.tp_size
    return np.concatenate(out)


def _expected(
    layout: KVCacheLayout, rank: RankInfo, layer: int, part: int, row_bytes: int, ntok: int, salt: int
) -> npt.NDArray[Any]:
    """(tokens, heads, words) of the request's content for one plane of one layer on this rank."""
    w = _word(layout, row_bytes)
    words = row_bytes // np.dtype(w).itemsize
    mask = np.uint64((1 << (8 * np.dtype(w).itemsize)) - 1)
    gh = global_heads(layout, rank).astype(np.uint64)
    j = _state_bytes(layout, rank) if layout.segments else np.arange(words, dtype=np.uint64)
    t = np.arange(ntok, dtype=np.uint64)
    # Odd multipliers spread layer, part, head, word, token and salt over all bits of the word; the
    # small tables are built in uint64 and the big sum wraps in the word type (one pass).
    base = gh[:, None] * np.uint64(0x9E3779B1) + j[None, :] * np.uint64(0x85EBCA77)
    base += np.uint64((layer * 0xC2B2AE3D + salt * 0x27D4EB2F + part * 0x61C88647) & 0xFFFFFFFF)
    tok = (t * np.uint64(0x165667B1)) & mask
    return (base & mask).astype(w)[None, :, :] + tok.astype(w)[:, None, None]


def _to_rows(layout: KVCacheLayout, plane: Plane, values: npt.NDArray[Any], nblocks: int) -> npt.NDArray[np.uint8]:
    """(tokens, heads, words) of ``nblocks`` blocks -> (blocks, kernel blocks, heads, tokens, elements, bytes)."""
    r, nk = layout.kernel_blocks_per_block, layout.tokens_per_kernel_block
    v = np.ascontiguousarray(values).view(np.uint8)
    return v.reshape(nblocks, r, nk, v.shape[1], plane.elements, -1).transpose(0, 1, 3, 2, 4, 5)


def _from_rows(rows: npt.NDArray[np.uint8], w: type[np.unsignedinteger[Any]]) -> npt.NDArray[Any]:
    """Inverse of :func:`_to_rows`: (tokens, heads, words)."""
    n, r, h, nk, _, _ = rows.shape
    return np.ascontiguousarray(rows.transpose(0, 1, 3, 2, 4, 5)).reshape(n * r * nk, h, -1).view(w)


def fill_blocks(buf: Any, rank: RankInfo, blocks: Sequence[int] | I64, salt: int) -> int:
    """Write the request's content into ``blocks`` of a KV buffer; returns the bytes written.

    ``buf`` is a :class:`~kvxfer.memory.SharedKVBuffer` or a :class:`CudaKVBuffer`: anything with a
    ``layout`` and ``rows(layer, plane)`` (the plane's rows indexed by block id).
    """
    layout: KVCacheLayout = buf.layout
    ids = np.asarray(blocks, dtype=np.int64)
    ntok = ids.size * layout.tokens_per_page
    for layer in range(layout.num_layers):
        for part, plane in enumerate(layout.planes):
            exp = _expected(layout, rank, layer, part, plane.row_bytes * plane.elements, ntok, salt)
            buf.rows(layer, plane)[ids] = _to_rows(layout, plane, exp, ids.size)
    return int(ids.size * layout.page_bytes * layout.num_layers)


def still_poisoned(buf: Any, blocks: Sequence[int] | I64) -> bool:
    """True when every byte of ``blocks`` still holds the poison (nothing landed since :func:`poison_blocks`)."""
    ids = np.asarray(blocks, dtype=np.int64)
    return all(
        bool(np.all(np.asarray(buf.rows(layer, plane)[ids]) == POISON))
        for layer in range(buf.layout.num_layers) for plane in buf.layout.planes
    )  # fmt: skip


def poison_blocks(buf: Any, blocks: Sequence[int] | I64) -> None:
    """Overwrite ``blocks`` so that a pull that moved nothing cannot pass verification."""
    ids = np.asarray(blocks, dtype=np.int64)
    for layer in range(buf.layout.num_layers):
        for plane in buf.layout.planes:
            buf.rows(layer, plane)[ids] = POISON


def verify_blocks(buf: Any, rank: RankInfo, blocks: Sequence[int] | I64, salt: int) -> tuple[int, int]:
    """Check ``blocks`` against the request's content; returns (bytes checked, bytes that differ)."""
    layout: KVCacheLayout = buf.layout
    ids = np.asarray(blocks, dtype=np.int64)
    ntok = ids.size * layout.tokens_per_page
    bad = 0
    for layer in range(layout.num_layers):
        for part, plane in enumerate(layout.planes):
            exp = _expected(layout, rank, layer, part, plane.row_bytes * plane.elements, ntok, salt)
            got = _from_rows(np.asarray(buf.rows(layer, plane)[ids]), _word(layout, plane.row_bytes * plane.elements))
            if not np.array_equal(got, exp):
                g8 = np.ascontiguousarray(got).view(np.uint8)
                e8 = np.ascontiguousarray(exp).view(np.uint8)
                bad += int(np.count_nonzero(g8 != e8))
    return int(ids.size * layout.page_bytes * layout.num_layers), bad


# ---------------------------------------------------------------------------- GPU memory
class _GpuPages:
    """A view of one layer on a GPU whose first dim is the block, indexed by numpy block ids like a numpy view."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def _index(self, ids: Any) -> Any:
        import torch

        return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self._view.device)

    def __getitem__(self, ids: Any) -> npt.NDArray[np.uint8]:
        return np.asarray(self._view[self._index(ids)].cpu().numpy())

    def __setitem__(self, ids: Any, value: Any) -> None:
        import torch

        if isinstance(value, int | np.integer):
            self._view[self._index(ids)] = int(value)
        else:
            self._view[self._index(ids)] = torch.from_numpy(np.ascontiguousarray(value)).to(self._view.device)
        # The sidecar's data plane copies on its own streams in another process: the bytes must be in
        # place before the worker publishes or pulls, not merely queued.
        if self._view.is_cuda:
            torch.cuda.synchronize(self._view.device)


class CudaKVBuffer:
    """GPU twin of :class:`~kvxfer.memory.SharedKVBuffer`: one CUDA tensor per region, shared by CUDA IPC.

    Each region is its own allocation; with ``pad`` > 0 the region starts ``pad`` bytes into it, the
    way a tensor carved from a caching allocator's segment does. :func:`fill_blocks`,
    :func:`poison_blocks` and :func:`verify_blocks` work on it unchanged (through host copies).
    """

    def __init__(self, layout: KVCacheLayout, device: int | str = 0, *, pad: int = 0) -> None:
        import torch

        self.layout = layout
        # A string names any torch device ("cpu" lets the page logic be tested without a GPU).
        self.device = torch.device(device) if isinstance(device, str) else torch.device("cuda", device)
        self._raw = [torch.empty(pad + layout.region_bytes, dtype=torch.uint8, device=self.device)
                     for _ in range(layout.num_regions)]  # fmt: skip
        self.regions = [r[pad:] for r in self._raw]

    def ref(self) -> Any:
        """What the sidecar needs: :meth:`kvxfer.memory.CudaIpcRef.from_tensors` of the regions."""
        from kvxfer.memory import CudaIpcRef

        return CudaIpcRef.from_tensors(self.regions)

    def pages(self, layer: int) -> _GpuPages:
        """(num_blocks, page_bytes) view of one layer's pages (layouts whose pages are contiguous)."""
        lay = self.layout
        region = self.regions[lay.region_of_layer(layer)]
        view = region[lay.layer_offset(layer) :].as_strided((lay.num_blocks, lay.page_bytes), (lay.block_stride, 1))
        return _GpuPages(view)

    def rows(self, layer: int, plane: Plane) -> _GpuPages:
        """``plane``'s rows of ``layer``: (blocks, kernel blocks, heads, tokens, elements, row bytes)."""
        lay = self.layout
        offset, shape, strides = lay.plane_view(layer, plane)
        region = self.regions[lay.region_of_layer(layer)]
        return _GpuPages(region.as_strided(shape, strides, region.storage_offset() + offset))

    def close(self) -> None:
        """Drop the tensors (after the sidecar let go of them)."""
        self.regions = []
        self._raw = []


# ---------------------------------------------------------------------------- worker process
@dataclass(frozen=True)
class WorkerConfig:
    """What a synthetic worker process needs."""

    name: str
    target: str  # its sidecar's local API
    layouts: dict[str, dict[str, Any]]  # group -> KVCacheLayout.to_dict()
    rank: tuple[int, int]  # tp_rank, tp_size
    token: str | None = None
    watch: bool = False  # follow the completion stream (prefill: count releases)
    memory: str = "shm"  # "shm" (shared memory) or "cuda:<device>" (GPU tensors shared by CUDA IPC)
    agent: str = ""  # a backend name: this process runs the data plane itself (a --backend worker sidecar)
    worker_gather: bool = False  # GPU memory: run the same-host gathers the sidecar hands out (kvxfer.client.gather)
    gather_warm_up: bool = True  # ... warming the gather's code while each answer is on its way

    def to_json(self) -> str:
        """The command-line form."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        d["rank"] = tuple(d["rank"])
        return cls(**d)


def worker_main(cfg: WorkerConfig, inp: IO[str], out: IO[str]) -> int:
    """Serve JSON-line commands from ``inp`` until ``["stop"]``; answers ``{"ok": result}`` or ``{"error": text}``."""
    from kvxfer.client import Client
    from kvxfer.client.gather import WorkerGather
    from kvxfer.fdpass import FdLease, fd_socket_path, send_fds
    from kvxfer.memory import SharedKVBuffer
    from kvxfer.worker_agent import WorkerAgent

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    rank = RankInfo(cfg.rank[0], cfg.rank[1])
    layouts = {g: KVCacheLayout.from_dict(d) for g, d in cfg.layouts.items()}
    buffers: dict[str, Any]
    if cfg.memory.startswith("cuda"):
        device = int(cfg.memory.partition(":")[2] or 0)
        buffers = {g: CudaKVBuffer(lay, device, pad=4096) for g, lay in layouts.items()}
    else:
        buffers = {g: SharedKVBuffer.create(lay) for g, lay in layouts.items()}
    gather: WorkerGather | None = None
    if cfg.worker_gather and cfg.memory.startswith("cuda"):
        gather = WorkerGather.from_tensors(device, {g: b.regions for g, b in buffers.items()},
                                           warm_up=cfg.gather_warm_up)  # fmt: skip
    events: dict[str, int] = {}
    agent: WorkerAgent | None = None
    client = Client(cfg.target, token=cfg.token, timeout=60.0)
    lease: FdLease | None = None
    try:
        client.wait_ready(60.0)
        if cfg.target.startswith(("unix:", "/", ".")):  # a Unix socket: its descriptor socket is beside it
            # Held while this process lives: when it exits, however, the sidecar drops the registration.
            lease = send_fds(fd_socket_path(cfg.target), [], token=cfg.token)
        if cfg.agent:  # the worker's own agent registers its memory; the sidecar maps nothing
            agent = WorkerAgent(cfg.agent)
            refs = {g: agent.register(layouts[g], b.regions) for g, b in buffers.items()}
            client.register_caches({g: (layouts[g], refs[g]) for g in buffers}, rank=rank, worker_id=cfg.name,
                                   worker_lease=lease.handle if lease else "", worker_agent=agent.info())  # fmt: skip
            client.submit(agent.serve(client.aio))
        else:
            client.register_caches({g: (layouts[g], b.ref()) for g, b in buffers.items()}, rank=rank,
                                   worker_id=cfg.name, worker_lease=lease.handle if lease else "")  # fmt: skip
        for b in buffers.values():
            if isinstance(b, SharedKVBuffer):
                b.unlink()  # the sidecar has mapped it: no name left behind in /dev/shm, however we exit
        if cfg.watch:
            threading.Thread(target=_watch, args=(client, events), daemon=True).start()
        reply({"ok": {"name": cfg.name, "bytes": sum(lay.total_bytes for lay in layouts.values())}})
        for line in inp:
            cmd = json.loads(line)
            if cmd[0] == "stop":
                reply({"ok": dict(events)})
                return 0
            try:
                reply({"ok": _handle(cmd, client, buffers, rank, gather)})
            except Exception as exc:
                reply({"error": f"{type(exc).__name__}: {exc}"})
        return 0
    except Exception:
        reply({"error": traceback.format_exc()})
        return 1
    finally:
        if agent is not None:
            try:
                client.call(agent.aclose(), timeout=agent.transport.config.fence_budget_s + 2.0)
            except Exception:
                agent.close()
        client.close()
        if gather is not None:
            gather.close()
        if lease is not None:
            lease.close()
        for b in buffers.values():
            b.close()


def _watch(client: Any, events: dict[str, int]) -> None:
    try:
        for ev in client.watch_completions():
            events[ev.kind] = events.get(ev.kind, 0) + 1
    except Exception:  # the stream ends when the sidecar stops
        return


def _handle(cmd: list[Any], client: Any, buffers: dict[str, Any], rank: RankInfo, gather: Any = None) -> dict[str, Any]:
    op = cmd[0]
    if op == "prefill":
        _, rid, blocks, salt, lease = cmd
        t0 = time.perf_counter()
        nbytes = sum(fill_blocks(buffers[g], rank, ids, salt) for g, ids in blocks.items())
        t1 = time.perf_counter()
        client.publish(rid, blocks, lease_seconds=lease)
        return {"bytes": nbytes, "fill_s": t1 - t0, "publish_s": time.perf_counter() - t1}
    if op == "produce":  # a prefill computed layer by layer: optionally streamed, then published
        _, rid, blocks, salt, layer_ms, stream, step, *gpu = cmd
        if gpu and gpu[0]:
            return _produce_on_gpu(client, buffers, rank, rid, blocks, salt, layer_ms, stream, step, gpu[0])
        for g, ids in blocks.items():
            fill_blocks(buffers[g], rank, ids, salt)  # the contents; each layer "completes" below
        ntok = {g: len(ids) * buffers[g].layout.tokens_per_page for g, ids in blocks.items()}
        if stream:
            lists = [common_pb2.BlockList(group=g, block_ids=list(ids)) for g, ids in blocks.items()]
            req = local_pb2.StreamedRequest(request_id=rid, blocks=lists, start_token=0, end_token=max(ntok.values()))
            client.call(client.aio.stream_step(step, [req]))
        layers = max(buffers[g].layout.num_layers for g in blocks)
        for layer in range(layers):
            time.sleep(layer_ms / 1000)  # the layer's compute (a synthetic producer: its KV is already in place)
            if stream:  # signalled, not waited for: the WRITE starts while the next layer computes
                for g in blocks:
                    client.submit(client.aio.layer_done(step, g, layer))
        t_last = time.monotonic()  # the last layer is computed
        client.publish(rid, blocks)
        return {"t_last": t_last}
    if op == "expect":  # what the decode scheduler says when a request arrives, before its blocks exist
        _, rid, addresses = cmd
        return {"held": client.expect(rid, addresses)}
    if op == "prepare":  # what the decode scheduler says as it allocates a request's blocks: the pull to come
        _, rid, addresses, blocks, engine, remote = cmd
        return {"prepared": client.prepare(rid, addresses, blocks, remote_blocks=remote, remote_engine_id=engine)}
    if op == "pull":
        # remote_blocks (optional): the publisher's block ids, as vLLM's kv_transfer_params carry them:
        # the sidecar may then READ on a grant or ahead of its lookup.
        _, rid, addresses, blocks, salt, engine, *more = cmd
        remote = more[0] if more else None
        push = bool(more[1]) if len(more) > 1 else False  # push mode: offered, the prefill side WRITEs
        # Tokens to move per group (push mode: what a layer-wise stream needs to plan each step).
        spans = {g: TokenSpan(int(n)) for g, n in more[2].items()} if len(more) > 2 and more[2] else None
        for g, ids in blocks.items():
            poison_blocks(buffers[g], ids)
        t_call = time.monotonic()
        t0 = time.perf_counter()
        res = client.pull(rid, addresses, blocks, remote_blocks=remote, remote_engine_id=engine, wait=True, push=push,
                          spans=spans, gather=gather)  # fmt: skip
        t_done = time.monotonic()
        latency = time.perf_counter() - t0
        checked = bad = 0
        for g, ids in blocks.items():
            c, b = verify_blocks(buffers[g], rank, ids, salt)
            checked, bad = checked + c, bad + b
        return {
            "latency_s": latency, "data_s": res.data_seconds, "bytes": res.bytes, "descriptors": res.descriptors,
            "checked": checked, "mismatched": bad, "verify_s": time.perf_counter() - t0 - latency,
            "warnings": list(res.warnings), "fetch_s": res.fetch_seconds, "duration_s": res.duration_seconds,
            "t_call": t_call, "t_done": t_done, "gather_us": dict(gather.last) if gather is not None else {},
        }  # fmt: skip
    if op == "status":
        return dict(client.status())
    raise ValueError(f"unknown command {op!r}")


#: GPU clock cycles per millisecond that ``torch.cuda._sleep`` spins (about an H100/H200's boost clock).
GPU_CYCLES_PER_MS = 1_900_000
_LAYER_EVENTS: dict[tuple[str, int], Any] = {}  # (group, layer) -> interprocess CUDA event, made once


def _produce_on_gpu(
    client: Any, buffers: dict[str, Any], rank: RankInfo, rid: str, blocks: dict[str, Any], salt: int,
    layer_ms: float, stream: bool, step: int, how: str,
) -> dict[str, Any]:  # fmt: skip
    """A prefill whose layers are GPU work the host does not wait for (``how``: ``events`` or ``no-events``).

    Each layer spins the GPU for ``layer_ms`` and then writes that layer's KV of the request (a
    device copy queued after the spin), as a model's attention layer does; with ``events`` it
    records the layer's interprocess event. The host only queues work and signals: the sidecar must
    wait for the event before it WRITEs the layer (``no-events`` shows what happens otherwise).
    """
    import torch

    staged: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
    for g, ids in blocks.items():
        buf = buffers[g]
        fill_blocks(buf, rank, ids, salt)
        for layer in range(buf.layout.num_layers):
            view = buf.pages(layer)._view
            index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=view.device)
            staged[(g, layer)] = (view, index, view[index].clone())
        poison_blocks(buf, ids)  # what a WRITE that did not wait for the layer would carry
    events = []
    for g, buf in buffers.items():
        if g not in blocks:
            continue
        for layer in range(buf.layout.num_layers):
            ev = _LAYER_EVENTS.get((g, layer))
            if ev is None:
                ev = torch.cuda.Event(enable_timing=False, interprocess=True)  # type: ignore[no-untyped-call]
                _LAYER_EVENTS[(g, layer)] = ev
                ev.record()
            if how == "events":
                events.append(local_pb2.LayerEvent(group=g, layer=layer, ipc_handle=bytes(ev.ipc_handle()),
                                                   device=buf.device.index))  # fmt: skip
    if stream:
        ntok = max(len(ids) * buffers[g].layout.tokens_per_page for g, ids in blocks.items())
        lists = [common_pb2.BlockList(group=g, block_ids=list(ids)) for g, ids in blocks.items()]
        req = local_pb2.StreamedRequest(request_id=rid, blocks=lists, start_token=0, end_token=ntok)
        client.call(client.aio.stream_step(step, [req], events))
    torch.cuda.synchronize()
    t_queue = time.monotonic()
    layers = max(buffers[g].layout.num_layers for g in blocks)
    for layer in range(layers):
        # the layer's kernels
        torch.cuda._sleep(int(layer_ms * GPU_CYCLES_PER_MS))  # type: ignore[no-untyped-call]
        for g in blocks:
            if (g, layer) in staged:
                view, index, values = staged[(g, layer)]
                view[index] = values  # its KV, written after its kernels on the same stream
                _LAYER_EVENTS[(g, layer)].record()
                if stream:
                    client.submit(client.aio.layer_done(step, g, layer))
    queued = time.monotonic() - t_queue
    torch.cuda.synchronize()
    t_last = time.monotonic()  # the last layer's KV is in memory
    client.publish(rid, blocks)
    return {"t_last": t_last, "queued_s": queued, "gpu_s": t_last - t_queue}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.harness.worker_sim '<WorkerConfig JSON>'``: commands on stdin, answers on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m kvxfer.harness.worker_sim '<WorkerConfig JSON>'", file=sys.stderr)
        return 2
    # Answers go to a private copy of stdout; the descriptor itself now points at stderr, so what a
    # library prints there (NIXL's agent, in a worker that runs the data plane) cannot break a line.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return worker_main(WorkerConfig.from_json(args[0]), sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
