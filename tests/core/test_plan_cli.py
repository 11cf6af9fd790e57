"""`kvxfer plan` and the purity of the core."""

from __future__ import annotations

import json
import subprocess
import sys

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
    assert [s["remote_rank"] for s in sources] == [0, 1]  # type: ignore[union-attr]
    assert [s["local_head"] for s in sources] == [0, 4]  # type: ignore[union-attr]
    assert r["descriptors"] == 2 * 32 * 6
    r = plan_json("--prefill-tp", "1", "--decode-tp", "2", "--decode-rank", "1", "--layout", "NHD", "--blocks", "0:4")
    assert r["descriptors"] == 32 * 4 * 16
    assert r["warnings"]


def test_plan_bad_input_exits_2_with_the_field() -> None:
    result = runner.invoke(app, ["plan", "--blocks", "0:3", "--remote-blocks", "5,5,6"])
    assert result.exit_code == 2
    assert "remote_blocks: block id 5 appears more than once" in result.output
    result = runner.invoke(app, ["plan", "--kv-heads", "6", "--decode-tp", "4"])
    assert result.exit_code == 2
    assert "6 heads cannot be split evenly over tp_size 4" in result.output


def test_core_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "import kvxfer.layout, kvxfer.topology, kvxfer.planning\n"
        "bad = [m for m in ('torch', 'grpc', 'nixl', 'mooncake', 'google.protobuf', 'prometheus_client') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
