"""bench/load.py itself: a short run of every phase, every open-loop path, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_runs_every_phase_and_every_open_loop_path() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--pulls", "40", "--concurrency", "4", "--serial", "5",
         "--open-loop-rate", "100", "--open-loop-seconds", "0.5", "--open-loop-paths", "plain,named,granted", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mismatched_bytes"] == 0
    for key in ("open_loop", "open_loop_named", "open_loop_granted"):
        assert r[key]["pulls"] == 50
        assert r[key]["failed"] == 0
    assert r["open_loop"]["peer_fetch_p50_ms"] > 0  # each pull looked its publish up
    assert r["open_loop_granted"]["peer_fetch_p50_ms"] == 0  # pulls read on their grants (a slow hold may miss one)
    # 40 concurrent + 40 batched + 3 x 5 serial + 3 x 50 open-loop (the warm-up pulls are not counted)
    assert r["verified_pulls"] == 40 + 40 + 15 + 150


def test_load_refuses_an_unknown_open_loop_path() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), "--open-loop-paths", "plain,bogus"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert "--open-loop-paths: 'bogus' is not one of plain, named, granted" in out.stderr
