"""How long a same-host GPU READ takes to translate a publisher's addresses (CPU only, no GPU needed).

Times :meth:`kvxfer.transport.cuda_ipc_direct.CudaIpcDirect._translate` (the peer's descriptor
addresses as addresses of its worker's memory mapped here) for a Llama-3-8B-shaped publisher (32
regions) and 64, 1,024 and 2,208 descriptors, as fragmented 16 MiB, 1 GiB and 2 GiB pulls have
on the lent H200. ``--compare DIR`` runs the same measurement again with the ``kvxfer`` package
found in ``DIR`` (e.g. ``.old/``, made with ``git archive <commit> kvxfer | tar -x -C .old``), in a
process of its own, and prints both side by side.

    python bench/translate_bench.py [--reps 2000] [--compare .old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

REGIONS = 32
REGION_BYTES = 1 << 28
DESCRIPTORS = (64, 1024, 2208)


def measure(reps: int) -> dict[str, Any]:
    """Median microseconds of one translation per descriptor count, with the kvxfer this process imports."""
    import kvxfer
    from kvxfer.transport.cuda_ipc_direct import CudaIpcDirect, _Export, _Peer

    bases = np.array([0x7F00_0000_0000 + i * REGION_BYTES for i in range(REGIONS)], dtype=np.uint64)
    exports = [_Export(int(b), REGION_BYTES, bytes([i]) * 64, i * REGION_BYTES, "GPU-0") for i, b in enumerate(bases)]
    try:  # since stop 38 a peer's exports are searched through a RegionIndex; --compare may time an older tree
        from kvxfer.topology import RegionIndex
    except ImportError:
        peer = _Peer(bases, bases + np.uint64(REGION_BYTES), exports)
    else:
        peer = _Peer(bases, RegionIndex.of(bases, np.full(REGIONS, REGION_BYTES, np.uint64)), exports)
    reader = CudaIpcDirect.__new__(CudaIpcDirect)  # _translate needs no backend; mapping is stubbed below
    reader._open = lambda e, ordinal: (ordinal, 0x5000_0000_0000)  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"kvxfer": os.path.dirname(kvxfer.__file__), "us": {}}
    for n in DESCRIPTORS:
        region = rng.integers(0, REGIONS, n)
        remote = np.stack([bases[region] + np.uint64(4096), np.full(n, 65536, np.uint64), np.zeros(n, np.uint64)],
                          axis=1).astype(np.uint64)  # fmt: skip
        reader._translate("peer", peer, remote, 0)  # maps every region once, as a peer's first READs do
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            reader._translate("peer", peer, remote, 0)
            times.append(time.perf_counter() - t0)
        out["us"][str(n)] = statistics.median(times) * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--compare", default="", help="a directory holding another kvxfer package to time beside this one")
    ap.add_argument("--json", action="store_true", help="print the measurement of this process as JSON only")
    args = ap.parse_args()
    mine = measure(args.reps)
    if args.json:
        print(json.dumps(mine))
        return 0
    rows = {"this tree": mine}
    if args.compare:
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.path.abspath(args.compare)}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--reps", str(args.reps), "--json"],
                              env=env, capture_output=True, text=True, check=True)  # fmt: skip
        rows[args.compare] = json.loads(proc.stdout)
    print("| kvxfer | " + " | ".join(f"{n} descriptors" for n in DESCRIPTORS) + " |")
    print("|---|" + "---|" * len(DESCRIPTORS))
    for name, r in rows.items():
        print(f"| {name} ({r['kvxfer']}) | " + " | ".join(f"{r['us'][str(n)]:.1f} us" for n in DESCRIPTORS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
