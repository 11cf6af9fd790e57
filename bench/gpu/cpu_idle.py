#!/usr/bin/env python3
"""How the host's idle CPUs wake, and a command run with idle CPUs kept from halting.

Stop 25 found (docs/notes/gpu.md, run 20) that on the lent virtual machines code that runs after
its thread slept runs 8-10x slower than back to back. This script tells whether the guest's idle
loop is what costs it, and measures a command under two ways of keeping CPUs out of it:

* ``probe``: the guest's cpuidle driver and governor, each idle state's exit latency and use, the
  haltpoll parameters, whether ``/dev/cpu_dma_latency`` (PM QoS) can be held.
* ``run --how qos|spin|none -- CMD...``: runs CMD while holding a PM QoS request of 0 us on
  ``/dev/cpu_dma_latency`` (``qos``: a cpuidle governor then picks only polling states; it does
  nothing where the guest has no cpuidle driver), or while one ``SCHED_IDLE`` spinner per CPU keeps
  every CPU busy (``spin``: any other thread that wakes preempts a spinner at once, so a CPU never
  halts and a wake-up is a context switch, not a return from the hypervisor), or neither.

  python3 bench/gpu/cpu_idle.py probe
  python3 bench/gpu/cpu_idle.py run --how spin -- python3 bench/gpu/gather_check.py --gap-ms 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        return f"<{exc.strerror}>"


def probe() -> dict[str, Any]:
    """What decides how this machine's idle CPUs sleep and wake."""
    states = []
    for state in sorted(Path("/sys/devices/system/cpu/cpu0/cpuidle").glob("state*")):
        states.append({k: _read(state / k) for k in ("name", "latency", "usage", "time", "disable")})
    haltpoll = Path("/sys/module/haltpoll/parameters")
    qos = Path("/dev/cpu_dma_latency")
    return {
        "cpus": os.cpu_count(),
        "driver": _read(CPUIDLE / "current_driver"),
        "governor": _read(CPUIDLE / "current_governor_ro"),
        "cpu0_states": states,
        "haltpoll": {p.name: _read(p) for p in sorted(haltpoll.glob("*"))} if haltpoll.exists() else None,
        "cpu_dma_latency": os.access(qos, os.W_OK) if qos.exists() else None,
        "hypervisor": "hypervisor" in _read(Path("/proc/cpuinfo")),
    }


@contextlib.contextmanager
def qos_held(us: int) -> Iterator[None]:
    """Hold a PM QoS CPU latency request of ``us`` microseconds while inside (released on close)."""
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    try:
        os.write(fd, struct.pack("i", us))
        yield
    finally:
        os.close(fd)


def _spin() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


@contextlib.contextmanager
def spinners() -> Iterator[None]:
    """One SCHED_IDLE busy loop per CPU while inside."""
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("probe")
    run = sub.add_parser("run")
    run.add_argument("--how", choices=("none", "qos", "spin"), required=True)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.verb == "probe":
        print(json.dumps(probe(), indent=1))
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("run: a command to run is required after --")
    hold = {"none": contextlib.nullcontext, "qos": lambda: qos_held(0), "spin": spinners}[args.how]
    with hold():
        print(f"cpu_idle: running with --how {args.how}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
