"""`kvxfer bench transport|topology --json`: one JSON object on stdout, figures that add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvxfer.bench.transport import bench_layout, fragmented_blocks

KVXFER = str(Path(sys.executable).parent / "kvxfer")


def _json_stdout(*args: str) -> dict[str, object]:
    out = subprocess.run([KVXFER, *args, "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout  # libraries' log lines belong on stderr
    result: dict[str, object] = json.loads(lines[0])
    return result


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_bench_transport_json(backend: str) -> None:
    r = _json_stdout("bench", "transport", "--backend", backend, "--size-mib", "16", "--repeat", "2")
    assert r["verified"] is True
    layout = bench_layout(16, 16)
    assert (r["bytes"], r["layers"], r["blocks"], r["page_bytes"]) == (16 << 20, 16, 64, 16384)
    # the remote list is runs of consecutive ids; each run is one descriptor per layer
    remote = fragmented_blocks(layout.num_blocks, np.random.default_rng(1))
    runs = 1 + int(np.count_nonzero(np.diff(remote) != 1))
    assert r["descriptors_kvxfer"] == 16 * runs
    assert r["descriptors_per_block"] == 16 * 64
    gbps = {k: r[f"gbps_{k}"] for k in ("raw", "kvxfer", "per_block", "memcpy")}
    assert all(isinstance(v, float) and v > 0 for v in gbps.values())
    assert r["ratio_kvxfer_raw"] == pytest.approx(gbps["kvxfer"] / gbps["raw"])  # type: ignore[operator]
    assert r["ratio_kvxfer_per_block"] == pytest.approx(gbps["kvxfer"] / gbps["per_block"])  # type: ignore[operator]
    assert r["ratio_kvxfer_memcpy"] == pytest.approx(gbps["kvxfer"] / gbps["memcpy"])  # type: ignore[operator]
    runs_gbps = r["runs_gbps"]
    assert isinstance(runs_gbps, dict)
    assert {k: len(v) for k, v in runs_gbps.items()} == {"raw": 2, "kvxfer": 2, "per_block": 2, "memcpy": 2}
    assert gbps["kvxfer"] == max(runs_gbps["kvxfer"])


def test_bench_topology_json() -> None:
    r = _json_stdout("bench", "topology", "--layers", "4", "--blocks", "64", "--repeat", "2")
    cases = r["cases"]
    assert isinstance(cases, dict)
    assert {k: (c["descriptors"], c["per_block_descriptors"], c["target_ms"]) for k, c in cases.items()} == {
        "same_tp/contiguous": (4, 256, 1.0),
        "same_tp/fragmented": (256, 256, 20.0),
        "decode_tp_2x/contiguous": (256, 256, 20.0),
        "decode_tp_2x/fragmented": (256, 256, 20.0),
        "same_tp/one_block": (4, 4, 1.0),
        "decode_tp_2x/one_block": (4, 4, 1.0),
        # 64 of the 64 blocks in two random orders: a few pairs happen to continue on both sides.
        "same_tp/request_64": (252, 256, 20.0),
        "decode_tp_2x/request_64": (256, 256, 20.0),
    }
    assert all(c["meets_target"] == (c["numpy_ms"] < c["target_ms"]) for c in cases.values())


def test_translate_bench_times_this_tree_and_another_side_by_side(tmp_path: Path) -> None:
    """bench/translate_bench.py: one row per kvxfer tree, a time for every descriptor count."""
    import shutil

    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "kvxfer", tmp_path / "kvxfer")  # "another tree": here a copy of this one
    out = subprocess.run([sys.executable, str(repo / "bench" / "translate_bench.py"), "--reps", "3", "--compare",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and " us |" in ln]
    assert [r.split(" (")[0] for r in rows] == ["| this tree", f"| {tmp_path}"]
    assert f"({tmp_path / 'kvxfer'})" in rows[1]  # the other tree's package was the one imported
    assert all(len(r.split(" us |")) == 4 for r in rows)  # three descriptor counts each


def test_dram_post_bench_reads_every_size_both_ways_byte_exact() -> None:
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "dram_post.py"), "--sizes-kib", "256,4096", "--reps", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mismatched_bytes"] == 0
    assert [(row["kib"], row["mode"]) for row in r["rows"]] == [(256, "loop"), (256, "thread"), (4096, "loop"),
                                                                (4096, "thread")]  # fmt: skip
    assert [row["descriptors"] for row in r["rows"]] == [4, 4, 4, 4]  # one per layer: the pulls are contiguous
    # the transport posting every READ from its thread did so for each of its reads; the other, none
    assert [row["thread_posts"] for row in r["rows"]] == [0, 2, 0, 4]
