"""bench/gpu/nixl_agents_bench.py on DRAM: two in-process NIXL agents, every byte verified, descriptor counts.

The GPU run differs only in where the caches are allocated (``--memory vram``); this pins the rest
here: the coalesced descriptors are exactly kvxfer's topology's, the per-block schemes post one per
block per layer (or what NIXL's merge of a prepared transfer leaves), and the block lists are the
sidecar bench's for the same seed (its rows and these report the same descriptor counts).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvxfer.topology import RankInfo, TransferTopology

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def _bench_module() -> Any:
    sys.path.insert(0, str(GPU_BENCH))
    try:
        return importlib.import_module("nixl_agents_bench")
    finally:
        sys.path.remove(str(GPU_BENCH))


def _run(script: str, out: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / script), "--out", str(out), *args],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_dram_rows_verified_and_descriptors_are_the_topologys(tmp_path: Path) -> None:
    stdout = _run("nixl_agents_bench.py", tmp_path, "--cpu-smoke", "--blocks", "64", "--sizes", "16,128", "--reps", "2")
    result = json.loads((tmp_path / "nixl_agents_bench.json").read_text())
    assert result["ok"] is True
    assert not result["stopped_early"]
    assert "| kvxfer coalesced |" in (tmp_path / "nixl_agents_bench.md").read_text()
    assert "per block+layer, no merge" in stdout
    mod = _bench_module()
    layout = mod.smoke_layout(64)
    lists = mod.block_lists(layout, [16, 128], 2, 64, 0)
    topo = TransferTopology(layout, layout, RankInfo(0, 1), 1)
    rows = {(r["blocks"], r["tokens"], r["path"].removeprefix("nixl-agents ")): r for r in result["rows"]}
    assert len(rows) == 2 * 2 * 3
    for (label, tokens), pairs in lists.items():
        blocks = -(-tokens // layout.block_size)
        nbytes = blocks * layout.num_layers * layout.page_bytes
        timed = pairs[1:]  # the first pair is the warm-up pull's
        plans = [topo.plan(d, p) for p, d in timed]
        coalesced = rows[(label, tokens, mod.COALESCED)]
        assert coalesced["descriptors_each"] == [plan.num_descriptors for plan in plans]
        for method in (mod.PREPPED, mod.UNMERGED):
            assert rows[(label, tokens, method)]["descriptors_each"] == [blocks * layout.num_layers] * 2
            assert [plan.per_block_descriptors for plan in plans] == [blocks * layout.num_layers] * 2
        # NIXL's merge of a prepared transfer leaves what kvxfer coalesces (same TP, one region per layer)
        assert rows[(label, tokens, mod.PREPPED)]["posted_descriptors"] == coalesced["descriptors"]
        for method in mod.METHODS:
            row = rows[(label, tokens, method)]
            assert row["verified_bytes"] == 3 * nbytes  # warm-up + 2 timed pulls
            assert (row["mismatched_bytes"], row["stray_bytes"], row["reps"]) == (0, 0, 2)
            assert row["data_GBps"] > 0
            assert row["data_ms"] >= row["post_ms"] > 0
    contiguous = [r for r in result["rows"] if r["blocks"] == "contiguous" and r["path"].endswith(mod.COALESCED)]
    assert all(r["descriptors"] <= 2 * layout.num_layers for r in contiguous)  # at most one wrap of the cache
    assert any("cma" in ln or "zero-copy" in ln for ln in result["facts"]["ucx_read_protocol"])


def test_sidecar_bench_with_agents_rows_use_the_same_lists(tmp_path: Path) -> None:
    _run("sidecar_vram_bench.py", tmp_path, "--cpu-smoke", "--with-nixl-agents", "--blocks", "64", "--sizes", "16,128",
         "--modes", "lookup")  # fmt: skip
    result = json.loads((tmp_path / "sidecar_bench.json").read_text())
    assert result["ok"] is True
    assert result["facts"]["nixl_agents"]["ok"] is True
    by_path: dict[str, dict[tuple[str, int], float]] = {}
    for r in result["rows"]:
        by_path.setdefault(r["path"], {})[(r["blocks"], r["tokens"])] = r["descriptors"]
    assert set(by_path) == {"default+lookup", "nixl-agents kvxfer coalesced", "nixl-agents per block+layer, NIXL merge",
                            "nixl-agents per block+layer, no merge"}  # fmt: skip
    assert by_path["nixl-agents kvxfer coalesced"] == by_path["default+lookup"]  # the sidecar's lists and descriptors


def test_the_side_by_side_table_gives_each_kvxfer_path_its_verdict() -> None:
    """One "yes/no" column per kvxfer path: faster than every agents row of the same request."""
    mod = _bench_module()

    def row(path: str, tokens: int, gbps: float) -> dict[str, Any]:
        return {"path": path, "blocks": "contiguous", "tokens": tokens, "data_GBps": gbps, "data_vs_copy": gbps / 2000}

    rows = [row("sidecar", 128, 50.0), row("in-worker", 128, 70.0), row("sidecar", 1024, 500.0),
            row("in-worker", 1024, 400.0), row("nixl-agents a", 128, 60.0), row("nixl-agents b", 128, 10.0),
            row("nixl-agents a", 1024, 450.0)]  # fmt: skip
    lines = mod.comparison(rows).splitlines()
    assert lines[0].endswith("| sidecar >= every agents row | in-worker >= every agents row |")
    assert lines[2].endswith("| no | yes |")  # 128: 50 < 60 <= 70
    assert lines[3].endswith("| yes | no |")  # 1024: 400 < 450 <= 500


def test_sidecar_bench_times_pulls_prepared_ahead(tmp_path: Path) -> None:
    """``--modes prepared``: each pull is prepared (Prepare, as the vLLM scheduler sends it) before the timed Pull."""
    _run("sidecar_vram_bench.py", tmp_path, "--cpu-smoke", "--blocks", "64", "--sizes", "16,128", "--reps", "2",
         "--modes", "granted,prepared", "--expect-lead-ms", "1", "--prepare-lead-ms", "1")  # fmt: skip
    result = json.loads((tmp_path / "sidecar_bench.json").read_text())
    assert result["ok"] is True
    rows = {(r["path"], r["blocks"], r["tokens"]): r for r in result["rows"]}
    assert {p for p, _, _ in rows} == {"default+granted", "default+prepared"}
    for (_, blocks, tokens), r in rows.items():
        assert (r["reps"], r["mismatched_bytes"], r["verified_bytes"]) == (2, 0, 2 * r["MiB"] * 2**20), (blocks, tokens)
    assert len(rows) == 8  # two modes x two sizes x fragmented and contiguous
