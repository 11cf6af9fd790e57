"""bench/soak.py itself: a short mixed pull/push run with faults, every byte verified, exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_mixes_pull_push_and_given_up_pushes() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--transfers", "80", "--configs", "3", "--concurrency", "6",
         "--mode", "mixed", "--faults", "0.3", "--seed", "5", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"], r["first_failures"]
    assert r["failures"] == 0
    assert r["pushed"] > 0
    assert r["faults"] > 0  # some pushes were given up on, and nothing landed in their blocks afterwards
    assert r["transfers"] + r["faults"] == 80
    assert r["verified_bytes"] > 0


def test_soak_refuses_a_bad_fault_share() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--faults", "1.5"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert "--faults: must be in [0, 1], got 1.5" in out.stderr
