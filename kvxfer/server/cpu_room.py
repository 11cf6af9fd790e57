"""How much CPU this process has: its cgroup's CPU limit and the CPUs it may run on (for busy polling).

Read once when a sidecar starts (:mod:`kvxfer.server.busy_poll` decides from them); nothing here
fails: what cannot be read counts as no limit.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_limit_cores", "host_cores"]


def cpu_limit_cores(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's CPU limit in cores (the tightest cgroup quota on its path), or None without one.

    cgroup v2: ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) of the process's cgroup and
    of each parent up to ``root``. cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the
    ``cpu`` controller's cgroup (-1: none). Anything unreadable counts as no limit.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    limits: list[float] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hier == "0" and not controllers:  # v2: the unified hierarchy
            here = root / rel if rel else root
            while True:
                limits.extend(_v2_limit(here / "cpu.max"))
                if here == root or root not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            for base in (root / "cpu,cpuacct", root / "cpu"):
                limits.extend(_v1_limit(base / rel if (base / rel).is_dir() else base))
    return min(limits) if limits else None


def _v2_limit(cpu_max: Path) -> list[float]:
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
        return [] if quota == "max" else [int(quota) / int(period or 100000)]
    except (OSError, ValueError, ZeroDivisionError):
        return []


def _v1_limit(cgroup: Path) -> list[float]:
    try:
        quota = int((cgroup / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))
