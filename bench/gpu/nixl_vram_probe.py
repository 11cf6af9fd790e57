#!/usr/bin/env python3
"""Standalone probe: why is NIXL UCX VRAM->VRAM slow on the lent GPU VM, and how fast can it go?

One command runs a whole experiment (meant for one `run` call on the lent H100/H200):

  * system facts: nvidia-smi (topo, nvlink, -q excerpts), driver/kernel, ldd of the UCX CUDA
    modules bundled in the nixl-cu13 wheel, PID namespace, /dev/shm;
  * torch device copy GB/s (CUDA events) on every GPU, across GPUs when there are two, pinned
    host<->device copies, P2P access, driver attributes (IPC/VMM/handle types), NVML NVLink state;
  * CUDA IPC in the VM: a tensor shared to a torch.multiprocessing child, copied and timed there;
  * an `ucx_info`-like dump of the bundled UCX (version, resources, config, debug lines of the
    transport query) through ctypes, since the wheel ships no ucx_info binary;
  * NIXL UCX VRAM->VRAM: two agents in one process and across two processes (multiprocessing
    spawn, agent metadata over a pipe), READ and WRITE, descriptors of 256 MiB, 1 MiB and 64 KiB
    (remote offsets permuted like a KV block table), bytes verified, under the UCX environments of
    a case matrix (--matrix diag: find the cause; --matrix tune: settings with the fix in place),
    each case in its own subprocess with a timeout and UCX_PROTO_INFO=y / UCX_LOG_LEVEL=info
    captured, so the chosen protocols/lanes are in the logs.

Findings and figures: docs/notes/gpu.md. In short: UCX 1.23 (bundled with nixl-cu13 1.5.1) turns
cuda_ipc get_zcopy off when NVML reports no NVLink (true in the pass-through VM), so READ falls back
to "software emulation" over tcp/lo (~0.5 GB/s); UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y fixes it. cuda_ipc
also refuses two agents of one process unless UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y.

Every sub-experiment runs in a subprocess with a timeout, so one failure does not end the run.
Output: a short table, $OUT/summary.json, $OUT/probe_logs.tgz, and one JSON line at the end.

Usage on the device machine (wheel carried in .whl, see docs/notes/gpu.md):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  PYTHONUNBUFFERED=1 python3 bench/gpu/nixl_vram_probe.py --out $OUT                 # diagnosis
  PYTHONUNBUFFERED=1 python3 bench/gpu/nixl_vram_probe.py --out $OUT --steps copy,nixl --matrix tune
Without a GPU, --cpu-smoke runs the same logic on DRAM (for checking the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback

MiB = 1 << 20
SCRIPT = os.path.abspath(__file__)

# UCX environments tried for NIXL; each (name, env overrides, modes, extra worker args).
# Note: the NIXL UCX backend refuses a UCX_TLS without cuda_copy when GPUs are present, and a UCX_TLS
# without tcp fails endpoint creation (NIXL asks for peer error handling, which shm lanes lack).
REC_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"}
MATRICES = {
    # diagnosis: why is it slow, which setting fixes it
    "diag": [
        ("default", {}, ("inproc", "xproc"), []),
        ("tls_ipc_copy_sm", {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"}, ("inproc", "xproc"), []),
        ("tls_tcp_copy", {"UCX_TLS": "tcp,cuda_copy"}, ("inproc", "xproc"), []),
        ("ipc_get_on", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, ("xproc",), []),
        ("ipc_get_on_same_proc", REC_ENV, ("inproc", "xproc"), []),
    ],
    # tuning with the fix in place: progress thread, settings in code, descriptors, size
    "tune": [
        ("rec_poison_each", REC_ENV, ("xproc",), ["--remote-poison", "each"]),
        ("rec", REC_ENV, ("inproc", "xproc"), []),
        ("rec_delay100us", REC_ENV, ("xproc",), ["--progress-delay-us", "100"]),
        ("rec_no_prog_thread", REC_ENV, ("xproc",), ["--no-prog-thread"]),
        (
            "engine_config_only",
            {},
            ("xproc",),
            [
                "--backend-params",
                json.dumps({"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=y,CUDA_IPC_ENABLE_SAME_PROCESS=y"}),
            ],
        ),
        ("rec_tls_ipc_copy_tcp", dict(REC_ENV, UCX_TLS="cuda_ipc,cuda_copy,tcp"), ("xproc",), []),
        ("rec_threads4", REC_ENV, ("xproc",), ["--backend-params", json.dumps({"num_threads": "4"})]),
        ("rec_sgl", dict(REC_ENV, NIXL_UCX_SGL_ENABLE="1"), ("xproc",), []),
        ("rec_1GiB", REC_ENV, ("xproc",), ["--size-mib", "1024", "--desc-kib", "0,16384,1024"]),
    ],
}


LOG_PREFIX_RE = re.compile(r"^\[[0-9.]+\]\s+\[[^\]]+\]\s*")
NOTE_RE = re.compile(r"cfg#|UCX\s+(ERROR|WARN|DIAG)|NIXL|Traceback|Error|same process|not reachable|nvlink", re.I)


def extract_proto(lines, limit=160):
    """UCX_PROTO_INFO tables for RMA (get/put) plus the lane summaries and warnings/errors."""
    out, table, prev_border = [], [], False

    def flush():
        if table and any("remote memory" in t for t in table):
            out.extend(t for t in table if not t.startswith("+-"))
        table.clear()

    for raw in lines:
        ln = LOG_PREFIX_RE.sub("", raw).rstrip()
        if ln.startswith("+-"):
            if prev_border:  # bottom border of one table followed by the top of the next
                flush()
            table.append(ln)
            prev_border = True
            continue
        prev_border = False
        if ln.startswith("|"):
            table.append(ln)
            continue
        flush()
        if NOTE_RE.search(ln) and "UCX_* env" not in ln and not ln.startswith("# cmd"):
            out.append(ln)
    flush()
    seen, uniq = set(), []
    for ln in out:
        if ln not in seen:
            seen.add(ln)
            uniq.append(ln)
    return uniq[:limit]


SMOKE = {"on": False}  # --cpu-smoke: DRAM tensors on the CPU, to test the logic without a GPU


def dev_str(i: int) -> str:
    return "cpu" if SMOKE["on"] else f"cuda:{i}"


def mem_kind() -> str:
    return "DRAM" if SMOKE["on"] else "VRAM"


def sync():
    if not SMOKE["on"]:
        import torch

        torch.cuda.synchronize()


def now() -> float:
    return time.perf_counter()


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- helpers


def fill_pattern(t, seed: int):
    """Deterministic, cheap, non-zero pattern in a uint8 CUDA/CPU tensor (any process, same result)."""
    import torch

    n = t.numel() // 8
    x = torch.arange(n, dtype=torch.int64, device=t.device)
    x = x * 6364136223846793005 + ((seed * 1442695040888963407 + 1) & ((1 << 62) - 1))
    x = x ^ (x >> 29)
    t.view(torch.int64)[:n].copy_(x)
    tail = t.numel() - n * 8
    if tail:
        t[n * 8 :].fill_(seed & 0xFF)
    return t


def sh(cmd: str, timeout: float = 30) -> str:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, errors="replace")
        return (p.stdout + p.stderr).strip()
    except Exception as e:
        return f"<{cmd!r} failed: {e}>"


def nixl_paths():
    """Locate the nixl_cu13 package and its bundled library folder without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("nixl_cu13")
    if spec is None or not spec.origin:
        return None, None
    pkg = os.path.dirname(spec.origin)
    libs = os.path.join(os.path.dirname(pkg), "nixl_cu13.libs")
    return pkg, libs if os.path.isdir(libs) else None


def write_json(path: str, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


# --------------------------------------------------------------------------- worker: copy


def worker_copy(args):
    import torch

    res = {"torch": torch.__version__, "cuda": torch.version.cuda}
    ndev = torch.cuda.device_count()
    res["device_count"] = ndev
    res["devices"] = [torch.cuda.get_device_name(i) for i in range(ndev)]
    nbytes = args.size_mib * MiB

    def time_copy(dst, src, iters=20):
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        med = statistics.median(ts)
        return {"median_s": med, "GBps_moved_once": nbytes / med / 1e9, "best_GBps": nbytes / min(ts) / 1e9}

    copies = {}
    for i in range(ndev):
        try:
            with torch.cuda.device(i):
                a = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}"), 1)
                b = torch.zeros_like(a)
                r = time_copy(b, a)
                r["verified"] = bool(torch.equal(a, b))
                copies[f"d2d_cuda{i}"] = r
                h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                copies[f"d2h_pinned_cuda{i}"] = time_copy(h, a, 5)
                copies[f"h2d_pinned_cuda{i}"] = time_copy(b, h, 5)
                del a, b, h
        except Exception as e:
            copies[f"cuda{i}_error"] = repr(e)
    if ndev >= 2:
        try:
            a = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), 2)
            b = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:1")
            with torch.cuda.device(0):
                r = time_copy(b, a)
            r["verified"] = bool(torch.equal(a.cpu(), b.cpu()))
            copies["d2d_cuda0_to_cuda1"] = r
        except Exception as e:
            copies["cross_gpu_error"] = repr(e)
    res["copies"] = copies

    # P2P
    p2p = {}
    for i in range(ndev):
        for j in range(ndev):
            if i != j:
                try:
                    p2p[f"{i}->{j}"] = torch.cuda.can_device_access_peer(i, j)
                except Exception as e:
                    p2p[f"{i}->{j}"] = repr(e)
    res["torch_can_device_access_peer"] = p2p if p2p else "single GPU: no peer to ask about"

    # Driver attributes through cuda-bindings (named enums, no magic numbers).
    attrs = {}
    try:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # type: ignore
        cu.cuInit(0)
        names = [
            "UNIFIED_ADDRESSING",
            "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
            "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
            "HANDLE_TYPE_FABRIC_SUPPORTED",
            "IPC_EVENT_SUPPORTED",
            "GPU_DIRECT_RDMA_SUPPORTED",
            "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
            "DMA_BUF_SUPPORTED",
            "MEMORY_POOLS_SUPPORTED",
            "MEMPOOL_SUPPORTED_HANDLE_TYPES",
            "PAGEABLE_MEMORY_ACCESS",
            "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES",
            "HOST_NATIVE_ATOMIC_SUPPORTED",
            "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
            "PCI_BUS_ID",
            "PCI_DEVICE_ID",
            "PCI_DOMAIN_ID",
            "MULTI_GPU_BOARD",
        ]
        for i in range(ndev):
            err, dev = cu.cuDeviceGet(i)
            d = {}
            for n in names:
                try:
                    enum = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + n)
                    err, v = cu.cuDeviceGetAttribute(enum, dev)
                    d[n] = int(v) if int(err) == 0 else f"err {err}"
                except Exception as e:
                    d[n] = f"n/a ({type(e).__name__})"
            attrs[f"cuda{i}"] = d
            for j in range(ndev):
                if i != j:
                    err, devj = cu.cuDeviceGet(j)
                    err, can = cu.cuDeviceCanAccessPeer(dev, devj)
                    attrs[f"cuDeviceCanAccessPeer_{i}_{j}"] = int(can)
    except Exception as e:
        attrs["error"] = repr(e)
    res["driver_attrs"] = attrs

    # NVML: what UCX's cuda_ipc looks at before enabling get_zcopy (NVLink count + remote PCI info).
    nv = {}
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        nv["driver"] = nvml.nvmlSystemGetDriverVersion()
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            d = {"name": nvml.nvmlDeviceGetName(h)}
            try:
                fv = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
                d["NVML_FI_DEV_NVLINK_LINK_COUNT"] = {
                    "nvmlReturn": int(fv.nvmlReturn),
                    "value": int(fv.value.uiVal),
                }
            except Exception as e:
                d["NVML_FI_DEV_NVLINK_LINK_COUNT"] = repr(e)
            links = {}
            for link in range(18):
                try:
                    st = nvml.nvmlDeviceGetNvLinkState(h, link)
                    links[link] = {"state": int(st)}
                    try:
                        pci = nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
                        links[link]["remote_bus"] = str(pci.busId)
                    except Exception as e:
                        links[link]["remote_pci_err"] = str(e)
                except Exception as e:
                    links[link] = str(e)
                    if link > 0:
                        break
            d["nvlinks"] = links
            try:
                m = nvml.nvmlDeviceGetVirtualizationMode(h)
                d["virtualization_mode"] = int(m)
            except Exception as e:
                d["virtualization_mode"] = str(e)
            nv[f"gpu{i}"] = d
        nvml.nvmlShutdown()
    except Exception as e:
        nv["error"] = repr(e)
    res["nvml"] = nv
    return res


# --------------------------------------------------------------------------- worker: CUDA IPC


def _ipc_child(q_in, q_out, nbytes):
    import torch

    out = {"pid": os.getpid()}
    try:
        t0 = now()
        t = q_in.get(timeout=60)  # CUDA tensor rebuilt from the IPC handle
        out["open_s"] = now() - t0
        ref = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=t.device), 7)
        out["verified_read"] = bool(torch.equal(t, ref))
        dst = torch.zeros_like(ref)
        for _ in range(3):
            dst.copy_(t)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(t)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        out["copy_from_ipc_GBps"] = nbytes / statistics.median(ts) / 1e9
        out["verified_copy"] = bool(torch.equal(dst, ref))
        # write into the parent's memory: parent checks it
        t[: 1 * MiB].fill_(0xAB)
        torch.cuda.synchronize()
        del t
    except Exception as e:
        out["error"] = traceback.format_exc(limit=3) or repr(e)
    q_out.put(out)
    q_out.close()
    q_out.join_thread()


def worker_ipc(args):
    import torch
    import torch.multiprocessing as mp

    res = {"allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    nbytes = args.size_mib * MiB
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    t = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), 7)
    torch.cuda.synchronize()
    p = ctx.Process(target=_ipc_child, args=(q_in, q_out, nbytes))
    t0 = now()
    p.start()
    q_in.put(t)
    try:
        child = q_out.get(timeout=90)
    except Exception as e:
        child = {"error": f"no answer from child: {e!r}"}
    res["child"] = child
    res["wall_s"] = now() - t0
    torch.cuda.synchronize()
    res["parent_sees_child_write"] = bool((t[: 1 * MiB] == 0xAB).all().item())
    p.join(timeout=20)
    if p.is_alive():
        p.kill()
    res["child_exitcode"] = p.exitcode
    res["ipc_works"] = bool(child.get("verified_read") and res["parent_sees_child_write"])
    return res


# --------------------------------------------------------------------------- worker: ucx_info-like


def worker_ucxinfo(args):
    """Prints UCX version, context resources, worker info and the full config through ctypes.

    Runs as its own process (output to a file): the final config dump may crash on ABI details,
    which then costs nothing but that dump.
    """
    import ctypes

    try:
        import torch

        torch.cuda.init()
    except Exception as e:
        print("torch cuda init failed:", e, flush=True)
    _, libs = nixl_paths()
    print("nixl libs:", libs, flush=True)
    ucs = ctypes.CDLL(glob.glob(libs + "/libucs-*.so*")[0], mode=ctypes.RTLD_GLOBAL)
    ucp = ctypes.CDLL(glob.glob(libs + "/libucp-*.so*")[0], mode=ctypes.RTLD_GLOBAL)
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    fp = ctypes.c_void_p(libc.fdopen(1, b"w"))
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    print("UCX version:", ucp.ucp_get_version_string().decode(), flush=True)
    maj, mi, rel = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(maj), ctypes.byref(mi), ctypes.byref(rel))
    cfg = ctypes.c_void_p()
    print("ucp_config_read:", ucp.ucp_config_read(None, None, ctypes.byref(cfg)), flush=True)
    params = (ctypes.c_uint64 * 64)()
    params[0] = 1  # UCP_PARAM_FIELD_FEATURES
    params[1] = (1 << 1) | (1 << 6)  # UCP_FEATURE_RMA | UCP_FEATURE_AM
    ctx = ctypes.c_void_p()
    st = ucp.ucp_init_version(maj.value, mi.value, params, cfg, ctypes.byref(ctx))
    print("ucp_init:", st, flush=True)
    ucp.ucp_context_print_info(ctx, fp)
    libc.fflush(fp)
    wp = (ctypes.c_uint64 * 64)()
    w = ctypes.c_void_p()
    print("ucp_worker_create:", ucp.ucp_worker_create(ctx, wp, ctypes.byref(w)), flush=True)
    ucp.ucp_worker_print_info(w, fp)
    libc.fflush(fp)
    print("---- config (UCX_*) ----", flush=True)
    gl = ctypes.c_char.in_dll(ucs, "ucs_config_global_list")
    ucs.ucs_config_parser_print_all_opts.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    ucs.ucs_config_parser_print_all_opts(fp, b"UCX_", 1, ctypes.c_void_p(ctypes.addressof(gl)))
    libc.fflush(fp)
    return {"ok": True}


# --------------------------------------------------------------------------- worker: NIXL


AGENT_OPTS = {"delay_us": 0, "backend_params": {}}


def _make_agent(name: str, prog_thread: bool):
    """nixl_agent with the UCX backend, an optional progress-thread delay and backend params."""
    import nixl_cu13._api as api
    from nixl_cu13 import nixl_agent, nixl_agent_config

    params = dict(AGENT_OPTS["backend_params"])
    cfg = nixl_agent_config(enable_prog_thread=prog_thread, backends=[] if params else ["UCX"])
    delay = int(AGENT_OPTS["delay_us"])
    base = api.nixlBind.nixlAgentConfig
    if delay > 0:

        class _Config(base):  # keeps nixl_agent from zeroing the delay (same trick as kvxfer)
            @property
            def pthrDelay(self):  # noqa: N802
                return int(base.pthrDelay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, _v):  # noqa: N802
                base.pthrDelay.__set__(self, delay)

        api.nixlBind.nixlAgentConfig = _Config
    try:
        agent = nixl_agent(name, cfg)
    finally:
        api.nixlBind.nixlAgentConfig = base
    if params:
        agent.create_backend("UCX", params)
    return agent


def _layouts(nbytes: int, desc_kib: str, seed: int = 3):
    """Descriptor layouts: '0' = one descriptor over the whole buffer; N = N-KiB descriptors whose
    remote offsets are a fixed permutation of the local ones (like a KV block table)."""
    import numpy as np

    out = {}
    for tok in desc_kib.split(","):
        k = int(tok)
        if k <= 0 or k * 1024 >= nbytes:
            out[f"1x{nbytes // MiB}MiB"] = (np.array([0], dtype=np.uint64), nbytes, None)
            continue
        small = k * 1024
        n = nbytes // small
        perm = np.random.default_rng(seed).permutation(n).astype(np.uint64)
        name = f"{n}x{k // 1024}MiB" if k % 1024 == 0 else f"{n}x{k}KiB"
        out[name] = (np.arange(n, dtype=np.uint64) * np.uint64(small), small, perm * np.uint64(small))
    return out


def _dlist(base: int, offs, size: int, dev: int):
    import numpy as np

    a = np.empty((len(offs), 3), dtype=np.uint64)
    a[:, 0] = offs + np.uint64(base)
    a[:, 1] = size
    a[:, 2] = dev
    return a


def _wait(agent, h, timeout: float) -> str:
    t_end = now() + timeout
    st = agent.check_xfer_state(h)
    while st == "PROC":
        if now() > t_end:
            return "TIMEOUT"
        st = agent.check_xfer_state(h)
    return st


def _expected_view(ref, offs_local, offs_remote, size):
    """For a READ into local from remote: local[offs_local[i]] == remote[offs_remote[i]]."""
    import torch

    if offs_remote is None:
        return ref
    n = len(offs_local)
    src = ref.view(n, size)
    idx = torch.as_tensor((offs_remote // size).astype("int64"), device=ref.device)
    out = torch.empty_like(src)
    out[torch.as_tensor((offs_local // size).astype("int64"), device=ref.device)] = src[idx]
    return out.view(-1)


def _bench_pair(
    initiator,
    remote_name,
    op,
    local_t,
    remote_base,
    dev_l,
    dev_r,
    layouts,
    budget_s,
    xfer_timeout,
    poison_local,
    check,
    poison_each=True,
):
    """Times one op over each layout. check(layout_name, offs_l, offs_r, size) -> bool verifies.

    poison_local() zeroes the destination; with poison_each=False only the warm-up and the last
    (verified) transfer get a poisoned destination."""

    out = {}
    for lname, (offs_l, size, offs_r_perm) in layouts.items():
        r = {}
        offs_r = offs_l if offs_r_perm is None else offs_r_perm
        try:
            t0 = now()
            ldesc = initiator.get_xfer_descs(_dlist(local_t.data_ptr(), offs_l, size, dev_l), mem_kind())
            rdesc = initiator.get_xfer_descs(_dlist(remote_base, offs_r, size, dev_r), mem_kind())
            h = initiator.initialize_xfer(op, ldesc, rdesc, remote_name)
            r["prep_s"] = now() - t0
            # warm-up (first use maps IPC handles, selects protocols)
            poison_local()
            sync()  # the transfer runs on UCX's own CUDA streams, not torch's: order by hand
            t0 = now()
            st = initiator.transfer(h)
            st = _wait(initiator, h, xfer_timeout) if st == "PROC" else st
            sync()
            r["first_s"] = now() - t0
            r["first_state"] = st
            if st != "DONE":
                r["error"] = f"first transfer state {st}"
                out[lname] = r
                continue
            r["verified_first"] = bool(check(lname, offs_l, offs_r, size))
            iters = int(max(2, min(20, budget_s / max(r["first_s"], 1e-4))))
            ts = []
            for it in range(iters):
                if poison_each or it == iters - 1:
                    poison_local()
                sync()
                t0 = now()
                st = initiator.transfer(h)
                st = _wait(initiator, h, xfer_timeout) if st == "PROC" else st
                if st != "DONE":
                    r["error"] = f"state {st}"
                    break
                sync()
                ts.append(now() - t0)
            if ts:
                nbytes = size * len(offs_l)
                r["iters"] = len(ts)
                r["median_s"] = statistics.median(ts)
                r["GBps"] = nbytes / r["median_s"] / 1e9
                r["best_GBps"] = nbytes / min(ts) / 1e9
                r["verified_last"] = bool(check(lname, offs_l, offs_r, size))
            with contextlib.suppress(Exception):
                r["backend"] = initiator.query_xfer_backend(h)
            initiator.release_xfer_handle(h)
        except Exception as e:
            r["error"] = repr(e)
            r["trace"] = traceback.format_exc(limit=4)
        out[lname] = r
        log(f"    {op} {lname}: {json.dumps({k: v for k, v in r.items() if k != 'trace'}, default=str)}")
    return out


def _agent_info(agent):
    info = {}
    for k, f in (
        ("plugins", lambda: agent.get_plugin_list()),
        ("ucx_plugin_params", lambda: agent.get_plugin_params("UCX")),
        ("ucx_backend_params", lambda: agent.get_backend_params("UCX")),
        ("ucx_backend_mem_types", lambda: agent.get_backend_mem_types("UCX")),
    ):
        try:
            info[k] = f()
        except Exception as e:
            info[k] = repr(e)
    return info


def worker_nixl_inproc(args):
    import torch

    nbytes = args.size_mib * MiB
    dev_l = 0
    dev_r = 1 if (args.cross_gpu and not SMOKE["on"] and torch.cuda.device_count() > 1) else 0
    res = {"mode": "inproc", "dev_local": dev_l, "dev_remote": dev_r}
    t0 = now()
    agent_a = _make_agent("initiator", args.prog_thread)
    agent_b = _make_agent("target", args.prog_thread)
    res["agents_s"] = now() - t0
    res["agent_info"] = _agent_info(agent_a)
    buf_l = torch.zeros(nbytes, dtype=torch.uint8, device=dev_str(dev_l))
    buf_r = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=dev_str(dev_r)), 11)
    sync()
    t0 = now()
    agent_a.register_memory([(buf_l.data_ptr(), nbytes, dev_l, "")], mem_kind())
    agent_b.register_memory([(buf_r.data_ptr(), nbytes, dev_r, "")], mem_kind())
    res["register_s"] = now() - t0
    res["remote_name"] = agent_a.add_remote_agent(agent_b.get_agent_metadata())
    agent_b.add_remote_agent(agent_a.get_agent_metadata())
    layouts = _layouts(nbytes, args.desc_kib)
    ref_r = buf_r.clone()

    def check_read(lname, offs_l, offs_r, size):
        exp = _expected_view(ref_r.to(buf_l.device), offs_l, offs_r if offs_r is not offs_l else None, size)
        return torch.equal(buf_l, exp)

    res["READ"] = _bench_pair(
        agent_a,
        res["remote_name"],
        "READ",
        buf_l,
        buf_r.data_ptr(),
        dev_l,
        dev_r,
        layouts,
        args.iter_budget_s,
        args.xfer_timeout_s,
        lambda: buf_l.zero_(),
        check_read,
    )
    # WRITE: local pattern -> remote buffer
    fill_pattern(buf_l, 12)
    ref_l = buf_l.clone()

    def check_write(lname, offs_l, offs_r, size):
        # remote[offs_r[i]] == local[offs_l[i]]  <=> READ-style check with roles swapped
        exp = _expected_view(ref_l.to(buf_r.device), offs_r, offs_l if offs_r is not offs_l else None, size)
        return torch.equal(buf_r, exp)

    res["WRITE"] = _bench_pair(
        agent_a,
        res["remote_name"],
        "WRITE",
        buf_l,
        buf_r.data_ptr(),
        dev_l,
        dev_r,
        layouts,
        args.iter_budget_s,
        args.xfer_timeout_s,
        lambda: buf_r.zero_(),
        check_write,
    )
    return res


def _xproc_target(conn, nbytes, dev, prog_thread, seed, smoke, agent_opts):
    """Child: owns the remote buffer; answers poison/verify requests over the pipe."""
    import numpy as np
    import torch

    SMOKE["on"] = smoke
    AGENT_OPTS.update(agent_opts)
    try:
        if not smoke:
            torch.cuda.set_device(dev)
        agent_b = _make_agent("target", prog_thread)
        buf_r = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=dev_str(dev)), seed)
        sync()
        agent_b.register_memory([(buf_r.data_ptr(), nbytes, dev, "")], mem_kind())
        conn.send({"meta": agent_b.get_agent_metadata(), "base": buf_r.data_ptr(), "dev": dev, "pid": os.getpid()})
        idle_until = now() + 120
        while True:
            if prog_thread:
                if not conn.poll(120):
                    break
            else:  # no progress thread: this process must progress its UCX worker itself
                if not conn.poll(0.0005):
                    agent_b.get_new_notifs()
                    if now() > idle_until:
                        break
                    continue
            idle_until = now() + 120
            msg = conn.recv()
            cmd = msg[0]
            if cmd == "peer":
                agent_b.add_remote_agent(msg[1])
                conn.send("ok")
            elif cmd == "poison":
                buf_r.zero_()
                sync()
                conn.send("ok")
            elif cmd == "verify_write":
                _, seed_l, offs_l, offs_r, size = msg
                ref = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=buf_r.device), seed_l)
                ol = np.asarray(offs_l, dtype=np.uint64)
                orr = None if offs_r is None else np.asarray(offs_r, dtype=np.uint64)
                exp = _expected_view(ref, orr if orr is not None else ol, ol if orr is not None else None, size)
                conn.send(bool(torch.equal(buf_r, exp)))
            elif cmd == "done":
                conn.send("bye")
                break
        os._exit(0)  # skip NIXL/UCX teardown (can hang with live CUDA contexts)
    except Exception:
        with contextlib.suppress(Exception):
            conn.send({"error": traceback.format_exc(limit=4)})


def worker_nixl_xproc(args):
    import multiprocessing as mp

    import torch

    nbytes = args.size_mib * MiB
    ndev = 0 if SMOKE["on"] else torch.cuda.device_count()
    dev_l = 0
    dev_r = 1 if (args.cross_gpu and ndev > 1) else 0
    res = {"mode": "xproc", "dev_local": dev_l, "dev_remote": dev_r}
    ctx = mp.get_context("spawn")
    pc, cc = ctx.Pipe()
    seed_r, seed_l = 21, 22
    p = ctx.Process(
        target=_xproc_target,
        args=(cc, nbytes, dev_r, args.prog_thread, seed_r, SMOKE["on"], dict(AGENT_OPTS)),
    )
    t0 = now()
    p.start()
    try:
        if not pc.poll(120):
            raise RuntimeError("target child did not answer in 120 s")
        hello = pc.recv()
        if "error" in hello:
            raise RuntimeError("target child failed: " + hello["error"])
        res["child_start_s"] = now() - t0
        agent_a = _make_agent("initiator", args.prog_thread)
        res["agent_info"] = _agent_info(agent_a)
        buf_l = torch.zeros(nbytes, dtype=torch.uint8, device=dev_str(dev_l))
        agent_a.register_memory([(buf_l.data_ptr(), nbytes, dev_l, "")], mem_kind())
        remote = agent_a.add_remote_agent(hello["meta"])
        pc.send(("peer", agent_a.get_agent_metadata()))
        pc.recv()
        layouts = _layouts(nbytes, args.desc_kib)
        ref_r = fill_pattern(torch.empty(nbytes, dtype=torch.uint8, device=buf_l.device), seed_r)

        def check_read(lname, offs_l, offs_r, size):
            exp = _expected_view(ref_r, offs_l, offs_r if offs_r is not offs_l else None, size)
            return torch.equal(buf_l, exp)

        res["READ"] = _bench_pair(
            agent_a,
            remote,
            "READ",
            buf_l,
            hello["base"],
            dev_l,
            dev_r,
            layouts,
            args.iter_budget_s,
            args.xfer_timeout_s,
            lambda: buf_l.zero_(),
            check_read,
        )
        fill_pattern(buf_l, seed_l)
        sync()

        def poison_remote():
            pc.send(("poison",))
            pc.recv()

        def check_write(lname, offs_l, offs_r, size):
            pc.send(("verify_write", seed_l, offs_l.tolist(), None if offs_r is offs_l else offs_r.tolist(), size))
            return pc.recv()

        res["WRITE"] = _bench_pair(
            agent_a,
            remote,
            "WRITE",
            buf_l,
            hello["base"],
            dev_l,
            dev_r,
            layouts,
            args.iter_budget_s,
            args.xfer_timeout_s,
            poison_remote,
            check_write,
            poison_each=(args.remote_poison == "each"),
        )
        res["remote_poison"] = args.remote_poison
    finally:
        try:
            pc.send(("done",))
            pc.poll(10) and pc.recv()
        except Exception:
            pass
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
        res["child_exitcode"] = p.exitcode
    return res


# --------------------------------------------------------------------------- orchestration


def run_worker(kind: str, args, env_over: dict, logpath: str, timeout: float, extra=()):
    """Runs one worker in a fresh interpreter; returns its JSON result (or an error record)."""
    resfile = logpath + ".json"
    env = dict(os.environ)
    env.update(env_over)
    cmd = [
        sys.executable,
        SCRIPT,
        "--worker",
        kind,
        "--result",
        resfile,
        "--size-mib",
        str(args.size_mib),
        "--desc-kib",
        args.desc_kib,
        "--iter-budget-s",
        str(args.iter_budget_s),
        "--xfer-timeout-s",
        str(args.xfer_timeout_s),
        "--remote-poison",
        args.remote_poison,
        "--progress-delay-us",
        str(args.progress_delay_us),
        "--backend-params",
        args.backend_params,
    ]
    if not args.prog_thread:
        cmd.append("--no-prog-thread")
    if args.cross_gpu:
        cmd.append("--cross-gpu")
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    cmd.extend(extra)  # later options win
    t0 = now()
    rec = {"env": env_over}
    try:
        with open(logpath, "w") as lf:
            lf.write(f"# cmd: {' '.join(cmd)}\n# env: {json.dumps(env_over)}\n")
            lf.flush()
            p = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        rec["rc"] = p.returncode
    except subprocess.TimeoutExpired:
        rec["rc"] = "timeout"
    except Exception as e:
        rec["rc"] = repr(e)
    rec["wall_s"] = round(now() - t0, 2)
    try:
        with open(resfile) as f:
            rec["result"] = json.load(f)
    except Exception:
        rec["result"] = None
    try:
        with open(logpath, errors="replace") as f:
            lines = f.read().splitlines()
        rec["log_tail"] = lines[-15:]
        rec["proto_lines"] = extract_proto(lines)
    except Exception:
        pass
    return rec


def system_facts(outdir: str):
    pkg, libs = nixl_paths()
    facts = {"nixl_pkg": pkg, "nixl_libs": libs, "python": sys.version.split()[0]}
    cmds = {
        "uname": "uname -a",
        "nvidia_smi_L": "nvidia-smi -L",
        "nvidia_smi_topo": "nvidia-smi topo -m",
        "nvidia_smi_nvlink": "nvidia-smi nvlink -s",
        "nvidia_smi_q": "nvidia-smi -q | grep -iE 'Driver Version|CUDA Version|Product Name|Virtualization|"
        "Host VGPU|Addressing Mode|Persistence|MIG Mode|Bus Id|Link Width|Max|BAR1|Total|Confidential|Fabric'"
        " | head -60",
        "dev_nvidia": "ls -la /dev/nvidia* 2>&1 | head -20",
        "dev_shm": "df -h /dev/shm; ls /dev/shm | head",
        "pidns": "ls -l /proc/self/ns/pid; cat /proc/sys/kernel/yama/ptrace_scope 2>&1",
        "ulimit": "ulimit -a | grep -iE 'locked|open files'",
        "ldconfig_cuda": "ldconfig -p | grep -E 'libcuda.so|libnvidia-ml|libcudart' | head",
        "nvidia_params": "grep -iE 'RmIpc|EnableStreamMemOPs|NVreg' /proc/driver/nvidia/params 2>&1 | head -20",
    }
    if libs:
        for mod in ("libuct_cuda", "libucm_cuda"):
            f = glob.glob(os.path.join(libs, "ucx", mod + ".so*"))
            if f:
                cmds["ldd_" + mod] = f"ldd {f[0]} | grep -E 'cuda|nvidia|not found'"
    for k, c in cmds.items():
        facts[k] = sh(c)
    return facts


def summarize(results: dict) -> dict:
    """Best rate per (env, mode, op, layout), plus the overall best verified one."""
    rows = []
    for key, rec in results.get("nixl", {}).items():
        r = rec.get("result") or {}
        for op in ("READ", "WRITE"):
            for lname, m in (r.get(op) or {}).items():
                rows.append(
                    {
                        "case": key,
                        "op": op,
                        "layout": lname,
                        "GBps": round(m.get("GBps", 0.0), 2),
                        "best_GBps": round(m.get("best_GBps", 0.0), 2),
                        "verified": bool(m.get("verified_first")) and bool(m.get("verified_last")),
                        "error": m.get("error"),
                    }
                )
    return {"rows": rows}


def main_orchestrator(args):
    t_start = now()
    outdir = args.out or os.environ.get("OUT") or os.path.abspath("probe_out")
    os.makedirs(outdir, exist_ok=True)
    logdir = os.path.join(outdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args)}

    def left():
        return args.budget_s - (now() - t_start)

    log("== system facts")
    try:
        results["system"] = system_facts(outdir)
        for k in ("nvidia_smi_L", "nvidia_smi_topo", "nvidia_smi_nvlink", "ldd_libuct_cuda", "ldd_libucm_cuda"):
            log(f"-- {k}:\n{results['system'].get(k)}")
    except Exception as e:
        results["system"] = {"error": repr(e)}

    base_env = {"PYTHONUNBUFFERED": "1"}
    if "copy" in args.steps:
        log("== torch copy / P2P / driver attrs / NVML")
        results["copy"] = run_worker("copy", args, base_env, os.path.join(logdir, "copy.log"), 120)
        log(json.dumps((results["copy"].get("result") or {}).get("copies"), default=str)[:1500])
        log(json.dumps((results["copy"].get("result") or {}).get("nvml"), default=str)[:1500])
    if "ipc" in args.steps and left() > 60:
        log("== CUDA IPC via torch.multiprocessing")
        results["ipc"] = run_worker("ipc", args, base_env, os.path.join(logdir, "ipc.log"), 150)
        log(json.dumps(results["ipc"].get("result"), default=str)[:1500])
    if "ucxinfo" in args.steps and left() > 60:
        log("== ucx_info-like dump (ctypes) + debug log of the transport query")
        results["ucxinfo"] = run_worker("ucxinfo", args, base_env, os.path.join(logdir, "ucxinfo.log"), 60)
        dbg_env = dict(base_env, UCX_LOG_LEVEL="debug")
        rec = run_worker("ucxinfo", args, dbg_env, os.path.join(logdir, "ucxinfo_debug.log"), 60)
        try:
            with open(os.path.join(logdir, "ucxinfo_debug.log"), errors="replace") as f:
                rec["interesting"] = [
                    ln
                    for ln in f.read().splitlines()
                    if re.search(r"cuda|nvlink|nvml|ipc|module|failed|unable|not found|reachable", ln, re.I)
                    and not re.search(r"current_link_width|hugetlb|ioctl\(|HUGETLB", ln)
                ][:150]
        except Exception:
            pass
        rec.pop("proto_lines", None)
        results["ucxinfo_debug"] = rec
        try:
            with open(os.path.join(logdir, "ucxinfo.log"), errors="replace") as f:
                txt = f.read()
            m = txt.split("---- config (UCX_*) ----")
            log(m[0][-3000:])
            if len(m) > 1:
                results["ucx_config_cuda"] = [
                    ln for ln in m[1].splitlines() if re.search(r"CUDA|^UCX_TLS|^UCX_PROTO_ENABLE|RNDV_SCHEME", ln)
                ]
        except Exception:
            pass
        for ln in (results["ucxinfo_debug"].get("interesting") or [])[:40]:
            log("   ", LOG_PREFIX_RE.sub("", ln)[:220])

    results["nixl"] = {}
    if "nixl" in args.steps:
        matrix = MATRICES[args.matrix]
        names = args.envs.split(",") if args.envs else [e[0] for e in matrix]
        for name, env_over, modes, extra in matrix:
            if name not in names:
                continue
            for mode in modes:
                if left() < 45:
                    log(f"!! budget: skipping {name}/{mode}")
                    results["nixl"][f"{name}/{mode}"] = {"skipped": "budget"}
                    continue
                env = dict(base_env, UCX_PROTO_INFO="y", UCX_LOG_LEVEL="info", **env_over)
                log(f"== NIXL {mode} case={name} env={env_over} args={extra}")
                rec = run_worker(
                    "nixl_" + mode,
                    args,
                    env,
                    os.path.join(logdir, f"nixl_{name}_{mode}.log"),
                    min(args.case_timeout_s, max(30, left() - 10)),
                    extra,
                )
                rec["extra_args"] = extra
                results["nixl"][f"{name}/{mode}"] = rec
                log(f"   rc={rec.get('rc')} wall={rec.get('wall_s')}s")
                r = rec.get("result") or {}
                if r.get("error") or rec.get("rc") != 0:
                    for ln in rec.get("log_tail", []):
                        log("   | " + ln)

    results["summary"] = summarize(results)
    results["elapsed_s"] = round(now() - t_start, 1)
    write_json(os.path.join(outdir, "summary.json"), results)
    try:
        with tarfile.open(os.path.join(outdir, "probe_logs.tgz"), "w:gz") as tf:
            tf.add(logdir, arcname="logs")
        shutil.rmtree(logdir, ignore_errors=True)
    except Exception as e:
        log("tar failed:", e)

    # table
    copy = ((results.get("copy") or {}).get("result") or {}).get("copies") or {}
    d2d = (copy.get("d2d_cuda0") or {}).get("GBps_moved_once")
    log("\n== results (GB/s, bytes moved once; median of timed iterations)")
    log(f"torch device copy cuda0: {d2d}")
    log(f"{'case':34s} {'op':5s} {'layout':14s} {'GB/s':>9s} {'best':>9s} ok  error")
    best = None
    for r in results["summary"]["rows"]:
        log(
            f"{r['case']:34s} {r['op']:5s} {r['layout']:14s} {r['GBps']:9.2f} {r['best_GBps']:9.2f} "
            f"{'y' if r['verified'] else 'n'}   {r['error'] or ''}"
        )
        if r["verified"] and (best is None or r["GBps"] > best["GBps"]):
            best = r
    ipc = (results.get("ipc") or {}).get("result") or {}
    final = {
        "device_copy_GBps": d2d,
        "best_nixl": best,
        "ratio_best_to_copy": (best["GBps"] / d2d) if (best and d2d) else None,
        "cuda_ipc_torch_works": ipc.get("ipc_works"),
        "cuda_ipc_torch_copy_GBps": (ipc.get("child") or {}).get("copy_from_ipc_GBps"),
        "rows": [[r["case"], r["op"], r["layout"], r["GBps"], r["verified"]] for r in results["summary"]["rows"]],
        "elapsed_s": results["elapsed_s"],
    }
    print("PROBE_SUMMARY " + json.dumps(final, default=str), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default $OUT or ./probe_out)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--desc-kib", default="0,1024,64", help="descriptor sizes in KiB (0 = one descriptor)")
    ap.add_argument("--iter-budget-s", type=float, default=1.5, help="timed seconds per (op, layout)")
    ap.add_argument("--xfer-timeout-s", type=float, default=20.0)
    ap.add_argument("--case-timeout-s", type=float, default=75.0)
    ap.add_argument("--budget-s", type=float, default=420.0, help="whole run; later cases skipped past it")
    ap.add_argument("--steps", default="copy,ipc,ucxinfo,nixl")
    ap.add_argument("--matrix", default="diag", choices=sorted(MATRICES), help="which NIXL case list to run")
    ap.add_argument("--envs", default="", help="comma list of case names of the matrix (default all)")
    ap.add_argument(
        "--remote-poison",
        default="ends",
        choices=("each", "ends"),
        help="xproc WRITE: zero the remote buffer (in the target process) before every timed "
        "transfer, or only before the first and the last (verified) ones",
    )
    ap.add_argument(
        "--progress-delay-us",
        type=int,
        default=0,
        help="NIXL progress-thread delay (the Python wrapper hard-codes 0; the sidecar uses 100)",
    )
    ap.add_argument("--backend-params", default="{}", help="JSON dict of UCX backend init params")
    ap.add_argument("--no-prog-thread", dest="prog_thread", action="store_false")
    ap.add_argument("--cross-gpu", action="store_true", help="remote buffer on cuda:1 when present")
    ap.add_argument("--cpu-smoke", action="store_true", help="DRAM on the CPU: test the logic without a GPU")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    SMOKE["on"] = args.cpu_smoke
    AGENT_OPTS["delay_us"] = args.progress_delay_us
    AGENT_OPTS["backend_params"] = json.loads(args.backend_params or "{}")

    if args.worker:
        fn = {
            "copy": worker_copy,
            "ipc": worker_ipc,
            "ucxinfo": worker_ucxinfo,
            "nixl_inproc": worker_nixl_inproc,
            "nixl_xproc": worker_nixl_xproc,
        }[args.worker]
        try:
            res = fn(args)
        except Exception:
            res = {"error": traceback.format_exc(limit=6)}
            log(res["error"])
        if args.result:
            write_json(args.result, res)
        sys.stdout.flush()
        # NIXL/UCX teardown with live CUDA contexts can hang; the result is already written.
        os._exit(0)
    main_orchestrator(args)


if __name__ == "__main__":
    main()
