"""Prepare the wheels the GPU scripts carry to the lent machine (run here, not there).

The lent machine's image (Python 3.12, torch 2.11+cu130) lacks NIXL, pydantic and the gRPC health,
reflection and status modules, and may hold grpcio/protobuf older than what ``kvxfer/wire/_proto`` was
generated with. Everything travels in ``.whl/`` (git-ignored), within the 64 MiB a call may carry:

* ``nixl-cu13==1.5.1`` is 59 MB; most of it is the NIXL-EP extension (three 31 MB torch builds),
  headers, example programs and storage plugins (GDS, object stores, ...) that a UCX data plane never
  loads. :func:`trim` rewrites it without them (about 16 MB) and fixes its RECORD so pip accepts it.
* ``nixl==1.5.1`` (the ``import nixl`` shim that picks nixl_cu12/nixl_cu13), grpcio and protobuf at
  the versions this repo generated its code with, grpcio-health-checking, grpcio-reflection,
  grpcio-status with googleapis-common-protos (the reasons in status details), pydantic,
  pydantic-core, annotated-types, typing-inspection, typing-extensions (pydantic needs >= 4.16).
  Installed with ``--target`` and put first on PYTHONPATH, they shadow the image's copies.

Usage: ``python3 bench/gpu/prep_wheels.py`` (downloads with pip, trims, prints the total size).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
WHEELS = (
    "nixl-cu13==1.5.1", "nixl==1.5.1", "grpcio==1.85.1", "protobuf==7.36.2", "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1", "grpcio-status==1.85.1", "googleapis-common-protos==1.76.0",
    "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "typing-extensions==4.16.0",
)  # fmt: skip
KEEP_PLUGINS = ("libplugin_UCX.so",)
LIMIT = 64 * 2**20


def _drop(name: str) -> bool:
    """Files of the nixl-cu13 wheel a UCX data plane does not need."""
    if name.startswith(("nixl_ep_cu13/", "nixl_cu13.scripts/")) or ".data/" in name:
        return True
    if "/ucx/libucx_perftest" in name:
        return True
    if "/nixl/libplugin_" in name or "/plugins/libplugin_" in name:
        return not name.endswith(KEEP_PLUGINS)
    return False


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def trim(src: Path, dst: Path) -> tuple[int, int]:
    """Rewrite the nixl-cu13 wheel ``src`` as ``dst`` without :func:`_drop` files; returns (kept, dropped)."""
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines: list[str] = []
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if _drop(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            lines.append(f"{info.filename},{_record_hash(data)},{len(data)}")
            kept += 1
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    return kept, dropped


def main() -> int:
    """Download, trim, report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(".whl"))
    args = ap.parse_args()
    args.dir.mkdir(exist_ok=True)
    plats = [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         "3.12", "--implementation", "cp", *plats, "-d", str(args.dir), *WHEELS], check=True,
    )  # fmt: skip
    wheel = next(args.dir.glob("nixl_cu13-1.5.1-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        untrimmed = any(_drop(n) for n in z.namelist())
    if untrimmed:
        staged = wheel.with_name(wheel.name + ".full")
        wheel.rename(staged)
        kept, dropped = trim(staged, wheel)
        staged.unlink()  # it would travel too and blow the limit
        print(f"trimmed {wheel.name}: kept {kept} files, dropped {dropped}")
    total = sum(p.stat().st_size for p in args.dir.iterdir())
    for p in sorted(args.dir.iterdir()):
        print(f"{p.stat().st_size / 1e6:8.2f} MB  {p.name}")
    print(f"total {total / 2**20:.1f} MiB (a call carries at most {LIMIT // 2**20} MiB with the working tree)")
    return 0 if total < LIMIT - 4 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
