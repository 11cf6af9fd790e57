"""A load whose READ may still land is not handed back to vLLM until the READ ended.

The prefill sidecar is stopped (SIGSTOP) after the decode side's Hold was granted and before the pull:
the READ (NIXL over UCX's TCP transport, which needs the peer's progress, as a remote one would)
stays in flight past the pull's deadline and the fence budget, so the pull fails with reason
``DATA_PLANE_UNFENCED``. vLLM recomputing into those blocks, or giving them to another request,
would let the late bytes overwrite that KV: the connector keeps the load unreported while the
decode sidecar names it in ``GetStatus.unsettled``, and reports it (its blocks as failed, for vLLM to
recompute) once the prefill sidecar resumes and the READ is seen to end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvxfer.client import Client
from kvxfer.harness.cluster import SidecarProc
from tests.vllm_inproc.pd import PD, Sidecars, decode_request
from tests.vllm_inproc.test_connector_parts import BS, engine, pages, publish, same

#: The decode sidecar's fence budget (s): short, so that the test sees the failure soon.
FENCE_S = 1.0
#: The pull's deadline (the connector's transfer_timeout_seconds).
DEADLINE_S = 1.0


@pytest.fixture
def tcp_pair(sidecars: Sidecars) -> Iterator[tuple[SidecarProc, SidecarProc]]:
    """A prefill and a decode sidecar whose UCX moves bytes over TCP only (cross-memory attach reads a
    stopped peer's memory without it); removed after the test."""
    cluster = sidecars.cluster
    env = {"UCX_TLS": "tcp"}
    flags = ("--lease-seconds", "20", "--fence-budget-seconds", str(FENCE_S))
    made = {name: [cluster.start_sidecar(f"{name}-0", name, role, flags=flags, env=env)]
            for name, role in (("pretcp1", "prefill"), ("dectcp1", "decode"))}  # fmt: skip
    for procs in made.values():
        _wait_up(procs[0])
    sidecars.sets.update(made)
    try:
        yield made["pretcp1"][0], made["dectcp1"][0]
    finally:
        for name, procs in made.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[0].proc.pid, signal.SIGCONT)
            procs[0].proc.terminate()
            procs[0].proc.wait(10)
            del sidecars.sets[name]


def _wait_up(sc: SidecarProc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert sc.proc.poll() is None, sc.log_tail()
        client = Client(sc.local_socket, timeout=2)
        try:
            client.status()
            return
        except Exception:
            assert time.monotonic() < deadline, sc.log_tail()
            time.sleep(0.2)
        finally:
            client.close()


def test_a_load_whose_read_may_still_land_keeps_its_blocks_until_the_read_ended(
    pd: PD, tcp_pair: tuple[SidecarProc, SidecarProc]
) -> None:
    prefill, _ = tcp_pair
    pre = pd.instance("prefill", [engine(1)], sidecars="pretcp1", engine_id="vllm-p")
    dec = pd.instance("decode", [engine(2)], sidecars="dectcp1", engine_id="vllm-d",
                      transfer_timeout_seconds=DEADLINE_S)  # fmt: skip
    p_blocks, d_blocks, tokens = [3, 4], [30, 31], 2 * BS
    # A first request: the sidecars handshake (the decode side then holds the publisher's region tables, and
    # reads on a grant or ahead of its lookup, which the stopped publisher will not answer).
    warm = publish(pd, pre, "p-warm", [1], BS)
    assert pd.load(dec, "d-warm", BS, warm, [[20]]) == set()
    pre.finished(sending="p-warm")
    params = publish(pd, pre, "p-late", p_blocks, tokens)
    req = decode_request("d-late", tokens, params)
    assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)  # queued: Expect, then the Hold's grant
    time.sleep(1.0)  # the Hold's grant comes meanwhile
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
        dec.step()
        # The pull fails unfenced DEADLINE_S + FENCE_S after it started; the load must not be reported
        # for as long as the prefill sidecar stays stopped (its READ may land any time).
        until = time.monotonic() + DEADLINE_S + FENCE_S + 3.0
        while time.monotonic() < until:
            _sending, recving, failed = dec.workers[0].finished()
            assert "d-late" not in recving | failed, "reported while its READ may still land"
            time.sleep(0.05)
        assert dec.workers[0].load_errors() == set()
        assert pd.sidecars.counter("dectcp1", "kvxfer_data_plane_unfenced_total", op="read") == 1
        assert pd.sidecars.counter("dectcp1", "kvxfer_unsettled_pulls") == 1
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    # The READ ends once its peer runs again: the load is reported, its blocks failed (vLLM recomputes them).
    _, recving, failed = dec.finished(recving="d-late", timeout=30)
    assert "d-late" in recving
    assert failed == set()
    assert dec.workers[0].load_errors() == set(d_blocks)
    assert pd.sidecars.counter("dectcp1", "kvxfer_unsettled_pulls") == 0
    # What landed late is the prefill's KV: nothing else wrote those blocks meanwhile.
    assert same(pages(dec.engines[0], d_blocks), pages(pre.engines[0], p_blocks))
    for w in pre.workers:
        with contextlib.suppress(Exception):
            w.sidecar.release("p-late")
