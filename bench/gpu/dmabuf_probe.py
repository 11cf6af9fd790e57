#!/usr/bin/env python3
"""Which route from a worker's VRAM to an RDMA NIC works here: dma-buf export, passing, registration.

A sidecar holds the worker's KV memory opened by CUDA IPC, which CUDA will not export again
(``cuIpcGetMemHandle`` fails on it) and which UCX moves at 0.3 GB/s. An RDMA NIC registers GPU
memory either through nvidia-peermem or as a dma-buf (``ibv_reg_dmabuf_mr``, what UCX does when
``cuMemGetHandleForAddressRange`` gives it a dma-buf fd). This probe answers, on the machine it
runs on:

1. device: does the GPU/driver support dma-buf (``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``)?
2. worker: ``cuMemGetHandleForAddressRange(DMA_BUF_FD)`` on the worker's own ``cudaMalloc`` memory
   (a torch tensor): an fd? What is it (``/proc/self/fd``, ``fdinfo``)?
3. passing: that fd over a Unix socket (SCM_RIGHTS, as ``kvxfer.fdpass`` passes CPU caches) to
   another process: does it arrive as the same dma-buf (same inode, exporter)?
4. sidecar: ``cuMemGetHandleForAddressRange`` on the same memory opened by CUDA IPC in another
   process: does CUDA export IPC-opened memory as a dma-buf, where it refuses an IPC handle?
5. NIC: are there RDMA devices (``/sys/class/infiniband``) to register either fd with? Without one,
   steps 2-4 are as far as a machine can prove the route.

  python3 bench/gpu/dmabuf_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for kvxfer

DMA_BUF_FD = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
ATTR_DMA_BUF_SUPPORTED = 124  # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
NBYTES = 64 << 20


def _export_dmabuf(base: int, size: int) -> tuple[int, str]:
    """(fd or -1, driver result) of cuMemGetHandleForAddressRange on [base, base + size)."""
    from kvxfer import cuda_ipc

    drv = cuda_ipc.driver()
    fn = drv._lib.cuMemGetHandleForAddressRange
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong]
    fn.restype = ctypes.c_int
    fd = ctypes.c_int(-1)
    with drv._current(0):
        rc = fn(ctypes.byref(fd), base, size, DMA_BUF_FD, 0)
    return (int(fd.value) if rc == 0 else -1), ("CUDA_SUCCESS" if rc == 0 else drv.error_text(rc))


def _describe_fd(fd: int) -> dict[str, Any]:
    st = os.fstat(fd)
    out: dict[str, Any] = {"link": os.readlink(f"/proc/self/fd/{fd}"), "inode": st.st_ino, "size": st.st_size}
    try:
        out["fdinfo"] = Path(f"/proc/self/fdinfo/{fd}").read_text().strip().splitlines()[:8]
    except OSError as exc:
        out["fdinfo"] = str(exc)
    return out


def _sidecar(conn: Any, sock: socket.socket, handle: bytes, offset: int) -> None:
    """Another process: receive the worker's dma-buf fd; open its IPC handle and try exporting that."""
    out: dict[str, Any] = {}
    try:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 1)
        out["received"] = {"message": msg.decode(), "fds": len(fds)}
        if fds:
            out["received"]["fd"] = _describe_fd(fds[0])
        from kvxfer import cuda_ipc

        base = cuda_ipc.driver().open(0, handle)
        out["ipc_opened_at"] = hex(base)
        fd, rc = _export_dmabuf(base + offset, NBYTES)
        out["ipc_opened_dmabuf"] = {"result": rc, **({"fd": _describe_fd(fd)} if fd >= 0 else {})}
    except Exception:
        out["error"] = traceback.format_exc()
    conn.send(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvxfer-dmabuf"))
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    try:
        import torch

        from kvxfer import cuda_ipc

        t = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:0")
        drv = cuda_ipc.driver()
        attr = ctypes.c_int(-1)
        drv._lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        rc = drv._lib.cuDeviceGetAttribute(ctypes.byref(attr), ATTR_DMA_BUF_SUPPORTED, 0)
        result["device_dma_buf_supported"] = int(attr.value) if rc == 0 else drv.error_text(rc)
        ptr = t.data_ptr()
        base, alloc = drv.allocation_range(0, ptr)
        result["worker_allocation"] = {"ptr": hex(ptr), "base": hex(base), "bytes": alloc}
        fd, rc_text = _export_dmabuf(ptr, NBYTES)
        result["worker_dmabuf"] = {"result": rc_text, **({"fd": _describe_fd(fd)} if fd >= 0 else {})}
        exp = drv.export(0, ptr)
        ctx = mp.get_context("spawn")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_sidecar, args=(child, theirs, exp.handle, exp.offset))
        proc.start()
        socket.send_fds(mine, [b"kv-dmabuf"], [fd] if fd >= 0 else [])
        result["sidecar"] = parent.recv() if parent.poll(120) else {"error": "no answer in 120 s"}
        proc.join(30)
        ib = Path("/sys/class/infiniband")
        result["rdma_devices"] = sorted(p.name for p in ib.iterdir()) if ib.exists() else []
        result["nvidia_peermem_loaded"] = Path("/sys/module/nvidia_peermem").exists()
        if fd >= 0 and "fd" in result["sidecar"].get("received", {}):
            same = result["sidecar"]["received"]["fd"]["inode"] == result["worker_dmabuf"]["fd"]["inode"]
            result["passed_fd_is_the_same_dmabuf"] = same
    except Exception:
        result["error"] = traceback.format_exc()
    text = json.dumps(result, indent=1, default=str)
    print(text, flush=True)
    (Path(args.out) / "dmabuf_probe.json").write_text(text)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
