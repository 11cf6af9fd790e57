"""bench/load.py itself: a short run of every phase, every open-loop path, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_load_runs_every_phase_and_every_open_loop_path() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--pulls", "40", "--concurrency", "4", "--serial", "5",
         "--open-loop-rate", "100", "--open-loop-seconds", "0.5", "--open-loop-paths", "plain,named,granted,prepared",
         "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mismatched_bytes"] == 0
    for key in ("open_loop", "open_loop_named", "open_loop_granted", "open_loop_prepared"):
        assert r[key]["pulls"] == 50
        assert r[key]["failed"] == 0
    assert r["open_loop"]["peer_fetch_p50_ms"] > 0  # each pull looked its publish up
    assert r["open_loop_granted"]["peer_fetch_p50_ms"] == 0  # pulls read on their grants (a slow hold may miss one)
    assert r["serial_prepared"]["peer_fetch_p50_ms"] == 0  # prepared, then read on its grant
    assert r["open_loop_prepared"]["peer_fetch_p50_ms"] == 0
    assert r["open_loop_prepared"]["not_prepared"] == 0  # every Prepare planned its pull
    for key in ("open_loop", "open_loop_prepared"):  # the collector pauses during the phase
        for side in ("prefill", "decode", "driver"):
            pauses = r[key]["gc_pauses"][side]
            # the longest pause's bucket bound exists exactly when there was a pause
            assert (pauses["longest_at_most_s"] > 0) == (pauses["count"] > 0)
    # 40 concurrent + 40 batched + 4 x 5 serial + 4 x 50 open-loop (the warm-up pulls are not counted)
    assert r["verified_pulls"] == 40 + 40 + 20 + 200


def test_load_reports_pulls_that_overtake_their_first_hold() -> None:
    """--expect-lead-ms 0: each pull comes right after its Expect, before its Hold's answer, which confirms it."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--pulls", "8", "--concurrency", "2", "--serial", "2",
         "--open-loop-rate", "50", "--open-loop-seconds", "0.5", "--open-loop-paths", "granted",
         "--expect-lead-ms", "0", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])["open_loop_granted"]
    assert r["failed"] == 0
    paths = r["pull_paths"]
    assert paths["grant"] + paths["hold_answer"] == r["pulls"] == 25  # no lookup on any pull's path
    assert paths["hold_answer"] >= 1
    assert paths["ahead"] == paths["lookup"] == paths["push"] == 0


def test_load_refuses_an_unknown_open_loop_path() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), "--open-loop-paths", "plain,bogus"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert "--open-loop-paths: 'bogus' is not one of plain, named, granted, prepared" in out.stderr


def test_load_runs_the_serial_phases_over_each_hop_side_by_side() -> None:
    """``--hop fast,blocking``: the serial phases once over the async client and once over the
    blocking client from a thread of its own; the open loop over the async one only."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--pulls", "8", "--concurrency", "2", "--serial", "4",
         "--open-loop-rate", "40", "--open-loop-seconds", "0.25", "--open-loop-paths", "granted",
         "--hop", "fast,blocking", "--sidecar-env", "KVXFER_BUSY_POLL_SECONDS=0.05", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mismatched_bytes"] == 0
    assert r["sidecar_env"] == {"KVXFER_BUSY_POLL_SECONDS": "0.05"}  # both sidecars polling: the same bytes
    assert set(r["by_hop"]) == {"fast", "blocking"}
    for hop in ("fast", "blocking"):
        for kind in ("serial", "serial_ahead", "serial_granted", "serial_prepared"):
            assert r["by_hop"][hop][kind]["measured"] == 4, (hop, kind)
    assert r["by_hop"]["blocking"]["serial_granted"]["peer_fetch_p50_ms"] == 0  # read on its grant
    assert "open_loop_granted" not in r["by_hop"]["blocking"]
    assert r["open_loop_granted"]["pulls"] == 10
    # 8 concurrent + 8 batched + 2 hops x 4 x 4 serial + 10 open-loop
    assert r["verified_pulls"] == 8 + 8 + 32 + 10


@pytest.mark.parametrize("hop", ["fast,bogus", "fast,fast", ""])
def test_load_refuses_a_hop_it_does_not_know(hop: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), "--hop", hop],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert f"--hop: {hop!r}: name each of fast, grpc, blocking at most once" in out.stderr


def test_load_passes_settings_to_both_sidecars() -> None:
    """``--sidecar-env`` reaches the sidecars: a value they refuse stops the run, naming it (a run
    with one they take is the side-by-side test above)."""
    base = [sys.executable, str(ROOT / "bench" / "load.py"), "--pulls", "4", "--concurrency", "2", "--serial", "2"]
    refused = subprocess.run([*base, "--sidecar-env", "KVXFER_BUSY_POLL_SECONDS=-1"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert refused.returncode != 0
    assert "busy_poll_seconds" in (refused.stdout + refused.stderr).lower().replace("-", "_")


@pytest.mark.parametrize("item", ["BUSY_POLL_SECONDS=1", "KVXFER_BUSY_POLL_SECONDS"])
def test_load_refuses_a_setting_it_cannot_pass(item: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "load.py"), "--sidecar-env", item],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2
    assert f"--sidecar-env: {item!r} is not KVXFER_<SETTING>=<value>" in out.stderr
