"""A vLLM worker killed with SIGKILL after registering its caches with the connector: nothing is left behind.

The worker is a process of its own that creates its caches with vLLM's code (``allocate_kv_cache``)
and registers them through the connector's worker half, as a vLLM worker does at engine start. It
is then killed without any chance to clean up. Its sidecar must drop the registration at once,
nothing of its KV memory may remain in /dev/shm, and the next worker (a restarted vLLM) registers
and moves KV right away.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvxfer.client import Client
from tests.vllm_inproc.pd import PD, Sidecars, fill_random, token_rows

REPO = Path(__file__).resolve().parents[2]
NOTICE_BOUND_S = 2.0

WORKER = r"""
import sys, time
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.topology import RankInfo
from tests.vllm_inproc.engine import GroupDef, attention_spec, build_engine, default_layers

spec = attention_spec(block_size=32, heads=4, head_size=64)
eng = build_engine([GroupDef(default_layers("self_attn.attn", 2), spec)], num_blocks=24)
w = WorkerSide(ConnectorSettings(sidecar_socket=sys.argv[1]), rank=RankInfo(0, 1), local_rank=0, worker_id="doomed")
w.register(eng.describe(), eng.kv_caches)
print("registered", flush=True)
time.sleep(600)
"""


def _shm_of(pid: int) -> list[str]:
    # torch names its shared-memory files after the creating process (torch_<pid>_...); kvxfer's own
    # segments are kvxfer-<pid>-...
    return [p for p in glob.glob("/dev/shm/*") if f"_{pid}_" in p or f"-{pid}-" in p]


def test_a_killed_vllm_worker_leaves_no_registration_and_no_shared_memory(sidecars: Sidecars, pd: PD) -> None:
    socket = sidecars.socket("pexit")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "registered", (line, proc.stderr.read() if proc.stderr else "")
        status = Client(socket.format(rank=0), timeout=5)
        try:
            assert status.status()["registered"]
            assert _shm_of(proc.pid) == []  # the cache file was unlinked when it was shared
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            t0 = time.monotonic()
            while status.status()["registered"]:
                assert time.monotonic() - t0 < NOTICE_BOUND_S, "the sidecar still holds the dead worker's caches"
                time.sleep(0.01)
            assert _shm_of(proc.pid) == []
        finally:
            status.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # The restarted worker registers at once and its KV moves exactly.
    from tests.vllm_inproc.engine import GroupDef, attention_spec, build_engine, default_layers

    layers = default_layers("self_attn.attn", 2)
    spec = attention_spec(block_size=32, heads=4, head_size=64)
    pre_eng, dec_eng = (build_engine([GroupDef(layers, spec)], num_blocks=24) for _ in range(2))
    fill_random(pre_eng, 11)
    fill_random(dec_eng, 12)
    pre = pd.instance("prefill", [pre_eng], sidecars="pexit")
    dec = pd.instance("decode", [dec_eng])
    p_table, d_table = [5, 9, 2], [3, 11, 4]
    params = pd.publish(pre, "after-exit", 80, [p_table])
    assert pd.load(dec, "after-exit", 80, params, [d_table]) == set()
    pre.finished(sending="after-exit")
    for layer in layers:
        assert token_rows(dec_eng, layer, d_table, range(79)).equal(token_rows(pre_eng, layer, p_table, range(79)))
