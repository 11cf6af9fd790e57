"""`kvxfer plan` and the purity of the core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_plan_json_mamba_state_split_over_tp() -> None:
    """A Mamba state in TP segments (vLLM's x, B, C, SSM): decode rank 3 of 4 reads its quarter of each
    segment from prefill rank 1 of 2, one descriptor per segment, block and layer."""
    r = plan_json("--kind", "mamba", "--mamba-segments", "384,96,96,1024", "--prefill-tp", "2", "--decode-tp", "4",
                  "--decode-rank", "3", "--layers", "2", "--blocks", "0:4")  # fmt: skip
    sources = r["sources"]
    assert isinstance(sources, list)
    assert [s["remote_rank"] for s in sources] == [1]
    assert sources[0]["reason"] == (
        "mamba state in 4 segments, each split evenly over TP: remote rank 1 holds slice 1 of 2 of each, local rank 3 "
        "needs slice 3 of 4"
    )
    assert (r["descriptors"], r["bytes"]) == (4 * 4 * 2, 4 * 400 * 2)
    first = sources[0]["first"][:4]
    assert [(d["local_offset"], d["remote_offset"], d["length"]) for d in first] == [
        (0, 96, 96), (96, 192 + 24, 24), (120, 240 + 24, 24), (144, 288 + 256, 256),
    ]  # fmt: skip


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


def error_line(*args: str) -> str:
    """Run `kvxfer <args>` expecting a usage error (exit 2); returns its one `error:` line."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.output
    assert not result.stdout, result.stdout
    return lines[0]


def test_plan_refuses_unknown_layout_and_dtype() -> None:
    assert error_line("plan", "--layout", "HDN") == "error: --layout: 'HDN' is not one of 'NHD', 'HND'"
    assert error_line("plan", "--dtype", "fp9").startswith("error: --dtype: unknown dtype 'fp9'; known: bf16")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        # A range with nothing in it used to reach numpy ("zero-size array to reduction operation maximum").
        (["--blocks", "5:2"], "--blocks: the range '5:2' is empty ('a:b' takes ids a to b-1, so a < b)"),
        (["--remote-blocks", "9:3"], "--remote-blocks: the range '9:3' is empty ('a:b' takes ids a to b-1, so a < b)"),
        (["--blocks", ""], "--blocks: '' names no block ids"),
        (["--blocks", "1,x"], "--blocks: cannot parse 'x' (use 'a:b' ranges or ids separated by commas)"),
        (["--blocks=-1"], "--blocks: block id -1 in '-1' is negative"),
        (["--blocks", "0:99999999999"], "--blocks: '0:99999999999' names more than 16777216 block ids"),
        (["--blocks", "0:3", "--remote-blocks", "5,5,6"], "--remote-blocks: block id 5 appears more than once"),
        (["--num-blocks", "4", "--blocks", "0:8"],
         "--blocks: block id 4 at position 4 is out of range [0, 4) (4 ids out of range)"),
        # The core says tp_rank and total_kv_heads; the user typed --decode-rank and --kv-heads.
        (["--decode-rank", "3"], "--decode-rank: 3 is not in [0, 1) (--decode-tp 1)"),
        (["--kv-heads", "6", "--decode-tp", "4"],
         "--kv-heads: 6 heads cannot be split evenly over tp_size 4 (decode side, --decode-tp 4)"),
        (["--kv-heads", "6", "--prefill-tp", "4"],
         "--kv-heads: 6 heads cannot be split evenly over tp_size 4 (prefill side, --prefill-tp 4)"),
        (["--kv-heads", "2", "--decode-tp", "3"],
         "--decode-tp: 3 ranks cannot replicate 2 heads evenly (decode side, --decode-tp 3)"),
        (["--kind", "mamba", "--prefill-tp", "2"],
         "--prefill-tp: a mamba page is opaque, so heterogeneous TP (local 1, remote 2) cannot be split per head; use "
         "the same TP size on both sides"),
        (["--kind", "mamba", "--mamba-segments", "384,96,96,1024", "--prefill-tp", "3"],
         "--mamba-segments: segment 3 of 1024 bytes does not split evenly over tp_size 3 (prefill side, "
         "--prefill-tp 3)"),
        (["--kind", "mamba", "--mamba-segments", "38x"],
         "--mamba-segments: '38x' is not a comma-separated list of byte sizes"),
        (["--mamba-segments", "4"], "--mamba-segments: only for --kind mamba, got --kind attention"),
        (["--remote-block-size", "24"],
         "--remote-block-size: 24 and --block-size 16: neither is a multiple of the other"),
        (["--kind", "quantized", "--dtype", "bf16"],
         "--dtype: a quantized head-group cache holds fp8_e4m3, fp8_e5m2, int8, nvfp4, got bf16"),
        (["--layers", "0"], "--layers: Input should be greater than or equal to 1 (got '0')"),
        (["--layers", "abc"],
         "--layers: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
        (["--decode-tp", "0"], "--decode-tp: Input should be greater than or equal to 1 (got '0')"),
        (["--kind", "foo"], "--kind: 'foo' is not one of 'attention', 'quantized', 'kv_planes', 'mla', 'mamba'"),
        # Flags take no value: a value after one is named with the flag.
        (["--json", "yes"], "yes: unexpected argument; --json takes no value"),
        (["--cross-layer", "no"], "no: unexpected argument; --cross-layer takes no value"),
        (["--bogus"], "--bogus: no such option (did you mean --blocks?)"),
        (["--blocks"], "--blocks: Option '--blocks' requires an argument"),
    ],
)  # fmt: skip
def test_plan_errors_name_the_flag_and_the_value(args: list[str], line: str) -> None:
    assert error_line("plan", *args) == f"error: {line}"


def test_plan_bad_input_exits_2_with_the_field() -> None:
    assert error_line("plan", "--blocks", "0:3", "--remote-blocks", "5,5,6") == (
        "error: --remote-blocks: block id 5 appears more than once"
    )
    assert "6 heads cannot be split evenly over tp_size 4" in error_line("plan", "--kv-heads", "6", "--decode-tp", "4")


def test_every_command_reports_errors_in_one_style() -> None:
    # One line `error: <flag>: <message>`, exit 2 for what the command was given, from every command.
    assert (
        error_line("nosuch")
        == "error: nosuch: no such command (the commands: bench, demo, drain, health, plan, serve, version)"
    )
    assert error_line("bench", "topology", "--layers", "0") == (
        "error: --layers: Input should be greater than or equal to 1 (got '0')"
    )
    assert error_line("bench", "transport", "--backend", "foo").startswith("error: --backend: must be one of ")
    assert error_line("demo", "--prefill-tp", "3") == (
        "error: --kv-heads: 8 heads cannot be split evenly over tp_size 3 (--prefill-tp 3)"
    )
    assert error_line("drain", "--timeout-seconds", "nan") == (
        "error: --timeout-seconds: must be a finite number >= 0 (0: the sidecar's --drain-seconds), got nan"
    )
    assert error_line("drain", "--target", "127.0.0.1:0").startswith("error: --target: port 0 in '127.0.0.1:0'")
    # health checks --target as drain does: a bad one is a usage error (2), not "no answer" (1).
    assert error_line("health", "--target", "").startswith("error: --target: must not be empty (a Unix socket path")
    assert error_line("health", "--target", "foo:bar").startswith("error: --target: 'foo:bar' has port 'bar'")
    assert (
        error_line("serve", "--lease-seconds", "nan")
        == "error: --lease-seconds: Input should be a finite number (got 'nan')"
    )
    assert error_line("serve", "--bogus", "1") == "error: --bogus: unknown flag (kvxfer serve --help lists the flags)"


def test_a_failure_at_run_time_exits_1_naming_the_flag(tmp_path: Path) -> None:
    result = runner.invoke(app, ["drain", "--target", str(tmp_path / "none.sock"), "--timeout-seconds", "1"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: --target: no sidecar answers at {tmp_path / 'none.sock'}: ")


def _help(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", *args, "--help"], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("command", [["plan"], ["drain"], ["demo"], ["bench", "topology"], ["bench", "transport"]])
def test_help_at_80_columns_names_every_flag_in_full(command: list[str]) -> None:
    import typer.main

    text = _help(*command)
    assert "…" not in text
    assert max(len(ln) for ln in text.splitlines()) <= 80
    group = typer.main.get_command(app)
    cmd = group
    for name in command:
        cmd = cmd.get_command(None, name)  # type: ignore[attr-defined]
    words = set(text.replace(",", " ").split())
    for param in cmd.params:
        for opt in param.opts:
            assert opt in words, f"{opt} is not whole in `kvxfer {' '.join(command)} --help`:\n{text}"
    # A flag takes no value, and its help line shows none.
    flag_lines = [ln.split() for ln in text.splitlines() if ln.strip().startswith("--json")]
    assert flag_lines in ([], [["--json", "Print", "one", "JSON", "object."]])


def test_serve_help_shows_every_setting_its_default_and_env() -> None:
    from kvxfer.config import Settings, env_name, flag_name

    text = _help("serve")
    assert "…" not in text
    assert max(len(ln) for ln in text.splitlines()) <= 80
    flat = " ".join(text.split())
    for name in Settings.model_fields:
        assert flag_name(name) in text.split(), name
        assert f"env {env_name(name)})" in flat, name
    assert flat.count("(default: ") == len(Settings.model_fields)
    shown = ("(default: 30; env KVXFER_LEASE_SECONDS)", "(default: 127.0.0.1:50051; env KVXFER_PEER_LISTEN)",
             "(default: true; env KVXFER_CUDA_IPC_DIRECT)", "(default: UCX; env KVXFER_NIXL_BACKENDS)",
             "(default: none; env KVXFER_TOKEN_FILE)", "(default: this host's name; env KVXFER_ENGINE_ID)")  # fmt: skip
    for default in shown:
        assert default in flat, default
    assert "--role {prefill,decode,both}" in text
    # A setting whose default is "not given" shows what the sidecar then does, not "none", which
    # for --metrics-auth is a value with the opposite meaning (an open /metrics).
    assert "--metrics-auth {token,none}" in text
    assert "(default: token with --token-file, else none; env KVXFER_METRICS_AUTH)" in flat
    assert "(default: --peer-listen's host" in flat


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
    assert (
        ours == "kvxfer,kvxfer.errors,kvxfer.layout,kvxfer.layout.compat,kvxfer.layout.geometry,kvxfer.layout.kinds,"
        "kvxfer.layout.model,kvxfer.layout.segments,kvxfer.layout.spans,kvxfer.layout.validation,"
        "kvxfer.layout.values,kvxfer.planning,kvxfer.topology,kvxfer.topology.blocks,kvxfer.topology.plans,"
        "kvxfer.topology.push,kvxfer.topology.transfer"
    )


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


def test_python_dash_m_kvxfer_is_the_kvxfer_command() -> None:
    """Where the console script is not on PATH (a bare `pip install --target`), `python -m kvxfer` runs it."""
    out = subprocess.run([sys.executable, "-m", "kvxfer", "--help"], capture_output=True, text=True, timeout=60,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for command in ("serve", "demo", "plan", "bench", "health", "drain"):
        assert f" {command} " in out.stdout, command
