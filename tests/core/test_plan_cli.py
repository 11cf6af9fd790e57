"""`kvxfer plan` and the purity of the core."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvxfer.cli import app

runner = CliRunner()


def plan_json(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, object] = json.loads(result.stdout)
    return out


def test_plan_json_counts_for_known_cases() -> None:
    r = plan_json("--layers", "64", "--blocks", "0:2048")
    assert (r["descriptors"], r["per_block_descriptors"], r["bytes"]) == (64, 64 * 2048, 64 * 2048 * 65536)
    assert len(r["regions"]) == 64  # type: ignore[arg-type]
    r = plan_json("--layers", "64", "--blocks", "0:2048", "--cross-layer")
    assert (r["descriptors"], len(r["regions"])) == (1, 1)  # type: ignore[arg-type]


def test_plan_json_heterogeneous_tp_names_the_sources() -> None:
    r = plan_json("--prefill-tp", "2", "--decode-tp", "1", "--blocks", "0:4,10:12", "--remote-blocks", "20:26")
    sources = r["sources"]
    assert isinstance(sources, list)
    assert [s["remote_rank"] for s in sources] == [0, 1]
    assert [s["local_head"] for s in sources] == [0, 4]
    assert r["descriptors"] == 2 * 32 * 6
    r = plan_json("--prefill-tp", "1", "--decode-tp", "2", "--decode-rank", "1", "--layout", "NHD", "--blocks", "0:4")
    assert r["descriptors"] == 32 * 4 * 16
    assert r["warnings"]


def test_plan_text_names_regions_descriptors_bytes_mean_and_per_block_count() -> None:
    args = ["plan", "--layers", "4", "--kv-heads", "8", "--head-size", "64", "--dtype", "fp16", "--block-size", "32",
            "--layout", "NHD", "--prefill-tp", "2", "--decode-tp", "4", "--decode-rank", "3", "--blocks", "0:3,7",
            "--remote-blocks", "10:14"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    # decode rank 3 of 4 holds heads [6, 8); prefill rank 1 of 2 holds [4, 8): rows of 256 B, pages of
    # 32 tokens x 2 heads; NHD needs one 512 B span per token: 4 layers x 4 blocks x 32 tokens
    assert "regions to register: 4 x 131072 B (one per layer)" in text
    assert "remote rank 1 holds heads [4, 8); local rank 3 needs [6, 8)" in text
    assert "descriptors: 512 bytes: 262144 mean descriptor: 512 B per-block-per-layer scheme: 512 (1.0x more)" in text
    assert "NHD with a head slice: 32 spans per chunk per layer (one per token)" in text
    r = plan_json(*args[1:])
    assert (r["descriptors"], r["bytes"], r["per_block_descriptors"]) == (512, 262144, 512)
    sources = r["sources"]
    assert isinstance(sources, list)
    assert [{k: v for k, v in s.items() if k != "first"} for s in sources] == [
        {"remote_rank": 1, "local_head": 0, "remote_head": 2, "num_heads": 2,
         "reason": "remote rank 1 holds heads [4, 8); local rank 3 needs [6, 8)", "descriptors": 512, "bytes": 262144}
    ]  # fmt: skip
    # token 0 of local block 0 <- token 0 of remote block 10 (pages of 32 x 4 x 256 B), heads 2, 3 of its row
    assert sources[0]["first"][0] == {"local_region": 0, "local_offset": 0, "remote_region": 0,
                                      "remote_offset": 10 * 32768 + 2 * 256, "length": 512}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "descriptors", "nbytes", "regions"),
    [
        # nvfp4 rows: 64 data + 8 scale bytes; K and V head groups: 2 heads -> 4 entries
        (["--kind", "quantized", "--dtype", "nvfp4", "--layers", "2", "--kv-heads", "2", "--blocks", "0:4"],
         2, 2 * 4 * 16 * 4 * 72, 2),
        (["--kind", "mla", "--head-size", "576", "--block-size", "64", "--layers", "3", "--prefill-tp", "2",
          "--decode-tp", "4", "--decode-rank", "3", "--blocks", "0:8"], 3, 3 * 8 * 64 * 576 * 2, 3),
        (["--kind", "mamba", "--head-size", "4096", "--block-size", "1", "--layers", "2", "--blocks", "0:4",
          "--remote-blocks", "4:8"], 2, 2 * 4 * 4096, 2),
        (["--layers", "2", "--block-size", "16", "--remote-block-size", "32", "--blocks", "0:4", "--remote-blocks",
          "2:4", "--layout", "NHD"], 2, 2 * 4 * 65536, 2),
        (["--layers", "8", "--cross-layer", "--blocks", "0:4,9", "--remote-blocks", "20:25"], 2, 8 * 5 * 65536, 1),
    ],
)  # fmt: skip
def test_plan_json_for_every_kind(args: list[str], descriptors: int, nbytes: int, regions: int) -> None:
    r = plan_json(*args)
    assert (r["descriptors"], r["bytes"], len(r["regions"])) == (descriptors, nbytes, regions)  # type: ignore[arg-type]


def test_plan_refuses_unknown_layout_and_dtype() -> None:
    result = runner.invoke(app, ["plan", "--layout", "HDN"])
    assert result.exit_code == 2
    assert "Invalid value for '--layout'" in result.output
    result = runner.invoke(app, ["plan", "--dtype", "fp9"])
    assert result.exit_code == 2
    assert "dtype: unknown dtype 'fp9'" in result.output


def test_plan_bad_input_exits_2_with_the_field() -> None:
    result = runner.invoke(app, ["plan", "--blocks", "0:3", "--remote-blocks", "5,5,6"])
    assert result.exit_code == 2
    assert "remote_blocks: block id 5 appears more than once" in result.output
    result = runner.invoke(app, ["plan", "--kv-heads", "6", "--decode-tp", "4"])
    assert result.exit_code == 2
    assert "6 heads cannot be split evenly over tp_size 4" in result.output


def test_core_imports_nothing_heavy() -> None:
    # A fresh interpreter: this test process has torch, typer etc. loaded already.
    code = (
        "import sys\n"
        "import kvxfer.layout, kvxfer.topology, kvxfer.planning\n"
        "tops = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))\n"
        "ours = sorted(m for m in sys.modules if m.startswith('kvxfer'))\n"
        "print(','.join(t for t in tops if not t.startswith(('_', 'kvxfer'))))\n"
        "print(','.join(ours))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    third_party, ours = out.stdout.splitlines()
    # numpy only: no torch, grpc, nixl, mooncake, protobuf, typer, pydantic...
    assert third_party == "numpy"
    assert ours == "kvxfer,kvxfer.errors,kvxfer.layout,kvxfer.planning,kvxfer.topology"


def test_plan_json_lists_where_an_nvfp4_head_slice_moves() -> None:
    # Decode rank 1 of TP 2 takes heads 4..8 of a TP-1 prefill: per side, the data rows then the scale rows.
    out = plan_json(
        "--kind", "quantized", "--dtype", "nvfp4", "--layers", "1", "--kv-heads", "8", "--head-size", "128",
        "--decode-tp", "2", "--decode-rank", "1", "--blocks", "0",
    )  # fmt: skip
    (src,) = out["sources"]  # type: ignore[misc]
    assert [(d["local_offset"], d["remote_offset"], d["length"]) for d in src["first"]] == [
        (0, 4096, 4096),  # K data of heads 4..8 (16 tokens x 64 bytes each)
        (4096, 8704, 512),  # K scales (16 tokens x 8 bytes each)
        (4608, 13312, 4096),  # V data
        (8704, 17920, 512),  # V scales
    ]
