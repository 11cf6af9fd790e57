#!/usr/bin/env python3
"""GPU checks of CUDA IPC registration that CPU tests cannot make; run on the lent GPU machine.

This process plays the worker (torch tensors on cuda:0); spawned children play sidecars:

1. export: ``CudaIpcRef.from_tensors`` of a tensor that starts 4 KiB into its allocation gives the
   allocation's handle and offset 4096, the tensor's size and the GPU's UUID.
2. attach: a child opens it with ``kvxfer.memory.attach`` and reads exactly the worker's bytes; a
   write by the child is seen by the worker; a second registration maps nothing new; closing both
   unmaps (mappings back to 0) and a later attach maps again. Bad handles and a foreign GPU UUID
   are refused with the field named; the worker's own process cannot open its own handle.
3. re-export: can a process export (cuIpcGetMemHandle) memory it opened by IPC? UCX's cuda_ipc
   transport does exactly that when the sidecar registers the worker's memory, so the answer
   decides whether a sidecar can move VRAM over cuda_ipc at all.
4. NIXL on IPC-opened memory: two sidecar-like children, each holding one worker tensor opened by
   IPC, registered as VRAM through ``kvxfer.transport`` (UCX engine_config defaults on); the second
   READs from the first (1 x 256 MiB, 256 x 1 MiB, 4096 x 64 KiB, remote chunks permuted), every
   variant verified by the worker, UCX_PROTO_INFO captured to see which protocol READ took.
5. the same copies done directly by the reader with cuMemcpyDtoDAsync on the worker's handle
   (what a kvxfer-native same-node path would get), and torch's device copy for reference.

Prints one line per check (PASS/FAIL/INFO) and writes $OUT/cuda_ipc_check.json (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kvxfer

MiB = 1 << 20
NBYTES = 256 * MiB
VARIANTS = (("1x256M", NBYTES), ("256x1M", MiB), ("4096x64K", 64 * 1024))
RESULTS: dict[str, Any] = {}


def report(name: str, ok: bool | None, detail: Any = "") -> None:
    tag = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    print(f"{tag:4} {name}: {detail}", flush=True)
    RESULTS[name] = {"ok": ok, "detail": detail}


# ---------------------------------------------------------------------------- raw driver helpers
def _fn(name: str, argtypes: list[Any]) -> Any:
    from kvxfer import cuda_ipc

    f = getattr(cuda_ipc.driver()._lib, name)
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


def _call(ordinal: int, name: str, argtypes: list[Any], *args: Any) -> None:
    from kvxfer import cuda_ipc

    drv = cuda_ipc.driver()
    with drv._current(ordinal):
        rc = _fn(name, argtypes)(*args)
    if rc:
        raise RuntimeError(f"{name}: {drv.error_text(rc)}")


def dtoh(ptr: int, n: int, ordinal: int = 0) -> bytes:
    buf = ctypes.create_string_buffer(n)
    _call(ordinal, "cuMemcpyDtoH_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t], buf, ptr, n)
    return buf.raw


def htod(ptr: int, data: bytes, ordinal: int = 0) -> None:
    _call(ordinal, "cuMemcpyHtoD_v2", [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t], ptr, data, len(data))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def cross_layout(nbytes: int) -> Any:
    """A one-region layout (cross-layer) of exactly ``nbytes``."""
    from kvxfer.layout import KVCacheLayout

    page = 2 * 16 * 8 * 2 * 128 * 2  # 2 layers x 16 tokens x 8 heads x (K+V) x 128 x bf16 = one block
    return KVCacheLayout.attention(
        num_layers=2, num_blocks=nbytes // page, block_size=16, num_kv_heads=8, head_size=128, cross_layer=True
    )


def ref_fields(ref: Any) -> dict[str, Any]:
    return {
        "handles": ref.handles,
        "offsets": ref.offsets,
        "device": ref.device,
        "sizes": ref.sizes,
        "device_uuid": ref.device_uuid,
    }


# ---------------------------------------------------------------------------- children
def _attach_child(conn: Connection, fields: dict[str, Any], layout: dict[str, Any], want: str) -> None:
    from kvxfer import cuda_ipc
    from kvxfer.errors import KvxferError
    from kvxfer.layout import KVCacheLayout
    from kvxfer.memory import CudaIpcRef, attach

    out: dict[str, Any] = {}
    try:
        ref, lay = CudaIpcRef(**fields), KVCacheLayout.from_dict(layout)
        t0 = time.perf_counter()
        a = attach(ref, lay)
        out["attach_s"] = time.perf_counter() - t0
        base, n = int(a.table.base[0]), lay.region_bytes
        out["read_sha_ok"] = sha(dtoh(base, n)) == want
        head = sha(dtoh(base, n - 4096))
        htod(base + n - 4096, b"\x5a" * 4096)
        b = attach(ref, lay)
        out["mappings_after_two_attaches"] = len(cuda_ipc.mappings)
        drv = cuda_ipc.driver()
        alloc_base, alloc_size = drv.allocation_range(0, base)
        out["allocation_range_of_opened"] = [alloc_base == base - ref.offsets[0], alloc_size]
        legacy = ctypes.c_int(-1)
        rc = _fn("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64])(
            ctypes.byref(legacy),
            10,
            alloc_base,  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        )
        out["imported_legacy_ipc_capable"] = [drv.error_text(rc) if rc else "ok", legacy.value]
        try:
            exp = drv.export(0, alloc_base)
            out["reexport"] = {"ok": True, "same_handle": exp.handle == ref.handles[0], "handle": exp.handle.hex()}
        except KvxferError as exc:
            out["reexport"] = {"ok": False, "error": exc.message}
        conn.send(out)
        conn.recv()  # the worker tried the re-exported handle in a third process
        a.close()
        out2: dict[str, Any] = {"mappings_after_one_close": len(cuda_ipc.mappings)}
        b.close()
        out2["mappings_after_both_closed"] = len(cuda_ipc.mappings)
        c = attach(ref, lay)
        out2["reattach_sha_ok"] = sha(dtoh(int(c.table.base[0]), n - 4096)) == head
        c.close()
        errors: dict[str, str] = {}
        for name, bad in (
            ("random_handle", CudaIpcRef((os.urandom(64),), (0,), 0)),
            ("foreign_uuid", CudaIpcRef(ref.handles, ref.offsets, 0, (), "GPU-00000000-0000-0000-0000-000000000000")),
        ):
            try:
                attach(bad, lay, field="groups[0].memory").close()
                errors[name] = "accepted"
            except KvxferError as exc:
                errors[name] = f"{exc.status} {exc.field}: {exc.message}"
        out2["errors"] = errors
        conn.send(out2)
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _open_child(conn: Connection, handle: bytes, offset: int, n: int, want: str) -> None:
    try:
        from kvxfer import cuda_ipc

        drv = cuda_ipc.driver()
        base = drv.open(0, handle)
        ok = sha(dtoh(base + offset, n)) == want
        drv.close(0, base)
        conn.send({"ok": ok})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _descs(base: int, size: int, perm: list[int] | None, dev: int) -> Any:
    import numpy as np

    idx = np.asarray(perm if perm is not None else range(NBYTES // size), dtype=np.uint64)
    return np.stack(
        [
            np.uint64(base) + idx * np.uint64(size),
            np.full(idx.size, size, np.uint64),
            np.full(idx.size, dev, np.uint64),
        ],
        axis=1,
    )


def _nixl_child(conn: Connection, role: str, fields: dict[str, Any], log_path: str) -> None:
    """role 'target': hold + register; 'reader': READ from the target and copy directly."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if role == "reader":
        os.environ["UCX_PROTO_INFO"] = "y"
    try:
        import numpy as np

        from kvxfer import cuda_ipc
        from kvxfer.memory import CudaIpcRef, attach
        from kvxfer.transport import TransportConfig, create_transport

        lay = cross_layout(NBYTES)
        mem = attach(CudaIpcRef(**fields), lay)
        t = create_transport("nixl", f"check-{role}", TransportConfig())
        t.register(mem.table, "VRAM")
        base = int(mem.table.base[0])
        if role == "target":
            conn.send({"metadata": t.metadata(), "base": base})
            conn.recv()  # until the reader is done
            t.close()
            mem.close()
            conn.send({"ok": True})
            return
        peer_info = conn.recv()
        peer = t.add_peer(peer_info["metadata"])
        rng = np.random.default_rng(7)
        res: dict[str, Any] = {"nixl": {}, "direct": {}}
        for name, size in VARIANTS:
            n = NBYTES // size
            perm = None if n == 1 else rng.permutation(n).tolist()
            local = _descs(base, size, None, 0)
            remote = _descs(peer_info["base"], size, perm, 0)
            times = []
            for _ in range(6):
                t0 = time.perf_counter()
                asyncio.run(t.read(peer, local, remote, timeout=60.0, mem_type="VRAM", remote_mem_type="VRAM"))
                times.append(time.perf_counter() - t0)
            conn.send({"verify": name, "perm": perm, "size": size})
            ok = conn.recv()
            med = statistics.median(times[1:])
            res["nixl"][name] = {
                "GBps": NBYTES / med / 1e9,
                "best_GBps": NBYTES / min(times[1:]) / 1e9,
                "first_s": times[0],
                "verified": ok,
            }
        # The direct path: this process opens the worker's source handle itself and copies with
        # kvxfer.cuda_ipc (what the sidecar's same-host shortcut does): one batched call, then one
        # cuMemcpyDtoDAsync per descriptor for comparison.
        src_fields = conn.recv()
        drv = cuda_ipc.driver()
        src_base = drv.open(0, src_fields["handles"][0]) + src_fields["offsets"][0]
        batch_fn = drv._batch
        for mode in ("batch", "loop"):
            drv._batch = batch_fn if mode == "batch" else None
            for name, size in VARIANTS:
                n = NBYTES // size
                perm = None if n == 1 else rng.permutation(n).tolist()
                dst = _descs(base, size, None, 0)
                srcd = _descs(src_base, size, perm, 0)
                times, calls = [], 0
                for _ in range(6):
                    t0 = time.perf_counter()
                    b = drv.copy_async(0, dst[:, 0], srcd[:, 0], dst[:, 1])
                    while not drv.done(b):
                        pass
                    times.append(time.perf_counter() - t0)
                    calls = b.calls
                conn.send({"verify": f"{mode} {name}", "perm": perm, "size": size})
                ok = conn.recv()
                res["direct"][f"{mode} {name}"] = {"GBps": NBYTES / statistics.median(times[1:]) / 1e9,
                                                   "verified": ok, "driver_calls": calls}  # fmt: skip
        res["batch_error"] = drv.batch_error
        # The floor of one READ: back to back, and right after the worker ran a kernel (as a sidecar
        # always runs: the worker just wrote or poisoned the blocks). Two processes on one GPU without
        # MPS share it by time slices.
        res["floor"] = {}
        for nbytes in (16 * MiB, NBYTES):
            for mode in ("back-to-back", "after a worker kernel"):
                times = []
                for _ in range(8):
                    if mode != "back-to-back":
                        conn.send({"kick": True})
                        conn.recv()
                    t0 = time.perf_counter()
                    drv.wait(drv.copy_async(0, np.array([base], np.uint64), np.array([src_base], np.uint64),
                                            np.array([nbytes], np.uint64)))  # fmt: skip
                    times.append(time.perf_counter() - t0)
                res["floor"][f"{nbytes // MiB} MiB {mode}"] = statistics.median(times[2:]) * 1e3
        conn.send({"done": res})
        t.close()
        mem.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})


# ---------------------------------------------------------------------------- the worker (this process)
def _recv(conn: Connection, timeout: float = 120.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("child did not answer")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


def check_attach(ctx: Any) -> None:
    import torch

    from kvxfer import cuda_ipc
    from kvxfer.errors import KvxferError
    from kvxfer.memory import CudaIpcRef, attach

    lay = cross_layout(32 * MiB)
    raw = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    view = raw[4096 : 4096 + lay.region_bytes]
    view.copy_(torch.randint(0, 256, (lay.region_bytes,), dtype=torch.uint8, device="cuda:0"))
    torch.cuda.synchronize()
    ref = CudaIpcRef.from_tensors([view])
    base, size = cuda_ipc.driver().allocation_range(0, raw.data_ptr())
    report(
        "export: offset inside the allocation",
        ref.offsets == (raw.data_ptr() - base + 4096,),
        f"offset {ref.offsets[0]}, allocation {size} bytes, size {ref.sizes[0]}, uuid {ref.device_uuid}",
    )
    torch_uuid = str(torch.cuda.get_device_properties(0).uuid).lower()
    report(
        "export: GPU UUID matches torch",
        torch_uuid.removeprefix("gpu-") in ref.device_uuid.lower(),
        f"{ref.device_uuid} vs {torch_uuid}",
    )
    want = sha(view.cpu().numpy().tobytes())
    try:
        attach(ref, lay).close()
        report("same process cannot open its own handle", False, "accepted")
    except KvxferError as exc:
        report("same process cannot open its own handle", True, f"{exc.status}: {exc.message[:200]}")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_attach_child, args=(child, ref_fields(ref), lay.to_dict(), want))
    p.start()
    out = _recv(parent)
    report("attach: child reads the worker's exact bytes", out["read_sha_ok"], f"attach {out['attach_s'] * 1e3:.1f} ms")
    torch.cuda.synchronize()
    report("attach: worker sees the child's write", bool((view[-4096:] == 0x5A).all().item()))
    report(
        "attach: second registration maps nothing new",
        out["mappings_after_two_attaches"] == 1,
        out["mappings_after_two_attaches"],
    )
    report("opened pointer's allocation range", None, out["allocation_range_of_opened"])
    report("imported memory legacy-IPC capable (rc, value)", None, out["imported_legacy_ipc_capable"])
    rex = out["reexport"]
    report("re-export of IPC-opened memory (cuIpcGetMemHandle)", None, {k: v for k, v in rex.items() if k != "handle"})
    if rex.get("ok"):
        q1, q2 = ctx.Pipe()
        g = ctx.Process(
            target=_open_child,
            args=(
                q2,
                bytes.fromhex(rex["handle"]),
                ref.offsets[0],
                lay.region_bytes - 4096,
                sha(view[:-4096].cpu().numpy().tobytes()),
            ),
        )
        g.start()
        got = _recv(q1)
        g.join(30)
        report("re-exported handle opens in a third process with the same bytes", got.get("ok"), got)
    parent.send("go")
    out2 = _recv(parent)
    p.join(30)
    report(
        "close: one of two registrations keeps the mapping",
        out2["mappings_after_one_close"] == 1,
        out2["mappings_after_one_close"],
    )
    report("close: last close unmaps", out2["mappings_after_both_closed"] == 0, out2["mappings_after_both_closed"])
    report("re-attach after close works", out2["reattach_sha_ok"])
    errs = out2["errors"]
    report(
        "random handle refused naming the field",
        "groups[0].memory.cuda_ipc.handles[0]" in errs["random_handle"],
        errs["random_handle"][:300],
    )
    report(
        "foreign GPU UUID refused naming the field", "device_uuid" in errs["foreign_uuid"], errs["foreign_uuid"][:300]
    )


def check_nixl(ctx: Any, outdir: Path) -> None:
    import torch

    from kvxfer.memory import CudaIpcRef

    src = torch.randint(0, 256, (NBYTES + 8192,), dtype=torch.uint8, device="cuda:0")[8192:]
    dst = torch.zeros(NBYTES + 4096, dtype=torch.uint8, device="cuda:0")[4096:]
    torch.cuda.synchronize()
    a_ref, b_ref = CudaIpcRef.from_tensors([src]), CudaIpcRef.from_tensors([dst])
    ta, tt = ctx.Pipe()
    ra, rr = ctx.Pipe()
    target = ctx.Process(target=_nixl_child, args=(tt, "target", ref_fields(a_ref), "/tmp/nixl_target.log"))
    reader = ctx.Process(target=_nixl_child, args=(rr, "reader", ref_fields(b_ref), str(outdir / "nixl_reader.log")))
    target.start()
    reader.start()
    info = _recv(ta)
    ra.send(info)
    results: dict[str, Any] = {}
    sent_src = False
    while True:
        msg = _recv(ra, 300)
        if "done" in msg:
            results = msg["done"]
            break
        if "kick" in msg:
            dst[:4096].add_(0)
            torch.cuda.synchronize()
            ra.send(True)
            continue
        size, perm = msg["size"], msg["perm"]
        torch.cuda.synchronize()
        exp = src if perm is None else src.view(-1, size)[torch.as_tensor(perm, device="cuda:0")].reshape(-1)
        ok = bool(torch.equal(dst, exp))
        dst.zero_()
        torch.cuda.synchronize()
        ra.send(ok)
        if msg["verify"] == VARIANTS[-1][0] and not sent_src:
            ra.send(ref_fields(a_ref))
            sent_src = True
    ta.send("done")
    _recv(ta)
    target.join(30)
    reader.join(30)
    for path, kind in ((outdir / "nixl_reader.log", "reader"),):
        lines = Path(path).read_text(errors="replace").splitlines()
        picked = []
        for i, ln in enumerate(lines):
            if "remote memory read" in ln:
                picked += [ln.strip(), *[x.strip() for x in lines[i + 1 : i + 9] if ".." in x][:3]]
            elif "nvlinks" in ln:
                picked.append(ln.strip())
        report(f"UCX protocol for READ ({kind})", None, picked[:8])
    copy = device_copy_gbps()
    report("batched device copies available", not results.get("batch_error"), results.get("batch_error") or "yes")
    for name, _size in VARIANTS:
        n = results["nixl"][name]
        report(
            f"NIXL READ IPC-opened VRAM {name}",
            n["verified"],
            f"{n['GBps']:.1f} GB/s (best {n['best_GBps']:.1f}; first {n['first_s'] * 1e3:.1f} ms) = "
            f"{n['GBps'] / copy:.3f} of copy {copy:.0f}",
        )
        for mode in ("batch", "loop"):
            d = results["direct"][f"{mode} {name}"]
            report(
                f"direct device copies from the worker's handle ({mode}) {name}",
                d["verified"],
                f"{d['GBps']:.1f} GB/s = {d['GBps'] / copy:.3f} of copy, {d['driver_calls']} driver calls",
            )
    for name, ms in results.get("floor", {}).items():
        report(f"one device copy of {name}", None, f"{ms:.3f} ms")
    RESULTS["figures"] = {"device_copy_GBps": copy, **results}


def device_copy_gbps(nbytes: int = NBYTES, src_dev: int = 0, dst_dev: int = 0) -> float:
    """torch copy of ``nbytes``, bytes moved once, median of 20 (CUDA events)."""
    from sidecar_vram_bench import copy_rate  # this directory; the one copy-rate method of bench/gpu

    return copy_rate(nbytes, src_dev, dst_dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    ap.add_argument("--skip-nixl", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    for name, fn in (("attach", lambda: check_attach(ctx)), ("nixl", lambda: check_nixl(ctx, args.out))):
        if name == "nixl" and args.skip_nixl:
            continue
        try:
            fn()
        except BaseException:
            report(f"{name} (crashed)", False, traceback.format_exc()[-1500:])
    (args.out / "cuda_ipc_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and v.get("ok") is False]
    print(f"cuda_ipc_check: {len(failed)} failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
