"""`kvxfer demo`: real sidecar and worker processes, one JSON object, non-zero exit on a bad byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.harness import demo
from kvxfer.harness.demo import run_demo
from kvxfer.harness.worker_sim import fill_blocks, verify_blocks
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import SharedKVBuffer
from kvxfer.topology import RankInfo


def test_demo_json_is_one_object_with_the_figures() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--json", "--requests", "6", "--layers", "8"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for key in ("requests", "verified_bytes", "gbps", "p50_ms", "p99_ms", "descriptors_per_request"):
        assert key in r
    assert r["ok"] is True
    assert r["requests"] == 6
    assert r["mismatched_bytes"] == 0
    assert r["verified_bytes"] == r["moved_bytes"] > 0
    assert r["released"] == 6
    assert r["descriptors_per_request"] < r["per_block_descriptors_per_request"]


def test_demo_heterogeneous_tp_nhd() -> None:
    r = run_demo(progress=False, requests=4, layers=4, prefill_tp=2, decode_tp=1, order="NHD")
    assert r["ok"], r
    assert r["mismatched_bytes"] == 0
    assert set(r["sidecar_exit_codes"]) == {"prefill-0", "prefill-1", "decode-0"}
    assert any("NHD" in w for w in r["warnings"])


def test_demo_with_the_workers_own_agents() -> None:
    # --backend worker: worker processes with their own NIXL agents, heterogeneous TP.
    r = run_demo(progress=False, requests=4, layers=4, prefill_tp=1, decode_tp=2, backend="worker")
    assert r["ok"], r
    assert r["backend"] == "worker"
    assert r["mismatched_bytes"] == 0
    assert r["verified_bytes"] == r["moved_bytes"] > 0
    assert r["released"] == 4


@pytest.mark.parametrize(("kind", "prefill_tp", "decode_tp"), [("attention", 2, 1), ("mla", 1, 2)])
def test_demo_push_mode(kind: str, prefill_tp: int, decode_tp: int) -> None:
    # --mode push: the decode workers offer first, the prefill sidecars WRITE; every byte verified.
    r = run_demo(progress=False, requests=4, layers=4, prefill_tp=prefill_tp, decode_tp=decode_tp, kind=kind,
                 mode="push")  # fmt: skip
    assert r["ok"], r
    assert r["mode"] == "push"
    assert r["mismatched_bytes"] == 0
    assert r["verified_bytes"] == r["moved_bytes"] > 0
    assert r["released"] == 4 * prefill_tp  # every prefill rank freed once its WRITEs landed


def test_demo_exits_non_zero_when_a_byte_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def corrupted(**_opts: object) -> dict[str, object]:
        return {"ok": False, "requests": 1, "verified_bytes": 10, "mismatched_bytes": 3}

    monkeypatch.setattr(demo, "run_demo", corrupted)
    assert demo.demo_main(as_json=True) == 1
    assert json.loads(capsys.readouterr().out)["mismatched_bytes"] == 3


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_verification_finds_a_single_wrong_byte(order: str) -> None:
    """What the demo's exit code rests on: one flipped byte in any block is counted, a good copy is not."""
    lay = KVCacheLayout.attention(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, total_kv_heads=4,
                                  head_size=64, order=order)  # fmt: skip
    rank = RankInfo(1, 2)
    with SharedKVBuffer.create(lay) as buf:
        fill_blocks(buf, rank, [5, 1, 2], salt=9)
        assert verify_blocks(buf, rank, [5, 1, 2], salt=9) == (3 * lay.page_bytes * 2, 0)
        assert verify_blocks(buf, rank, [5, 1, 2], salt=10)[1] > 0  # another request's contents
        assert verify_blocks(buf, RankInfo(0, 2), [5, 1, 2], salt=9)[1] > 0  # another rank's heads
        buf.pages(1)[2, 777] ^= 0x01
        assert verify_blocks(buf, rank, [5, 1, 2], salt=9) == (3 * lay.page_bytes * 2, 1)
        assert verify_blocks(buf, rank, [5, 1], salt=9)[1] == 0  # the flip is in block 2 only


def test_demo_shows_progress_and_a_table_without_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--requests", "3", "--layers", "2", "--layout", "nhd"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transfers: 3/3" in out.stderr  # no terminal here: progress comes as lines
    assert "every byte verified" in out.stdout
    assert "NHD" in out.stdout


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"backend": "rdma"}, "--backend: must be one of nixl, mooncake, worker, got 'rdma'"),
        ({"mode": "stream"}, "--mode: must be one of pull, push, got 'stream'"),
        ({"order": "XYZ"}, "--layout: must be one of NHD, HND, got 'XYZ'"),
        ({"kind": "ssm"}, "--kind: must be one of attention, quantized, kv_planes, mla, mamba, got 'ssm'"),
        ({"decode_tp": 0}, "--decode-tp: must be >= 1, got 0"),
        ({"min_tokens": 900, "max_tokens": 100}, "--min-tokens: 900 is more than --max-tokens 100"),
        # The core names total_kv_heads; the user typed --kv-heads (and --prefill-tp).
        ({"prefill_tp": 3}, "--kv-heads: 8 heads cannot be split evenly over tp_size 3 (--prefill-tp 3)"),
        ({"kv_heads": 2, "decode_tp": 3}, "--decode-tp: 3 ranks cannot replicate 2 heads evenly (--decode-tp 3)"),
        ({"dtype": "fp9"}, "--dtype: unknown dtype 'fp9'; known: bf16, bfloat16, float, float16, float32, "
                           "float8_e4m3fn, float8_e5m2, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2, half, int8, nvfp4, uint8"),
    ],
)  # fmt: skip
def test_demo_refuses_bad_options_before_starting_anything(
    option: dict[str, object], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.demo_main(as_json=True, **option) == 2
    out = capsys.readouterr()
    assert json.loads(out.out) == {"ok": False, "error": message}
    assert out.err == f"error: {message}\n"  # kvxfer's one error style, on stderr as well
