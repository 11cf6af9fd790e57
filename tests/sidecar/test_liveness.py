"""A worker killed with SIGKILL: its sidecar notices at once, drops what it registered, and takes the next one.

The workers are real processes (``python -m kvxfer.harness.worker_sim``): shared-memory KV, a lease
held on the sidecar's descriptor socket, commands on stdin. Nothing here cooperates with the
sidecar when it dies.
"""

from __future__ import annotations

import asyncio
import glob
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvxfer.client import AsyncClient, TokenSpan
from kvxfer.harness.cluster import WorkerProc
from kvxfer.harness.worker_sim import WorkerConfig
from kvxfer.layout import KVCacheLayout
from kvxfer.server.app import Sidecar
from tests.sidecar.helpers import DelayedDataPlane, Harness, attention, expect_error

#: How soon a sidecar must have dropped a dead worker's registration (the kernel closes the
#: worker's lease connection when it dies; the sidecar acts on the same loop iteration).
NOTICE_BOUND_S = 2.0


def _spawn(harness: Harness, sidecar: Sidecar, name: str, layouts: dict[str, KVCacheLayout]) -> WorkerProc:
    cfg = WorkerConfig(name, sidecar.local_target, {g: lay.to_dict() for g, lay in layouts.items()}, (0, 1))
    log_path = harness.tmp / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvxfer.harness.worker_sim", cfg.to_json()], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=logf, text=True,
        )  # fmt: skip
    return WorkerProc(name, proc, log_path)


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvxfer-{pid}-*")


async def _until(check: Callable[[], Awaitable[bool]], within: float) -> float:
    """Seconds until ``check`` holds (fails past ``within``)."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < within, f"not within {within}s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_a_killed_prefill_worker_is_dropped_and_its_successor_registers_at_once(harness: Harness) -> None:
    lay = attention()
    p = await harness.sidecar(role="prefill", engine_id="prefill", lease_seconds=600)
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": lay})
    watch = AsyncClient(p.local_target)
    try:
        victim = _spawn(harness, p, "victim", {"kv": lay})
        await asyncio.to_thread(victim.recv, 60)  # registered
        assert _segments(victim.proc.pid) == []  # unlinked as soon as the sidecar mapped it
        await asyncio.to_thread(victim.call, "prefill", "r1", {"kv": [1, 2]}, 1, 600)
        assert (await watch.status())["leases"] == 1
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 10)

        async def dropped() -> bool:
            s = await watch.status()
            return not s["registered"] and s["leases"] == 0

        elapsed = await _until(dropped, NOTICE_BOUND_S)
        # Its publish went with it (the blocks no longer exist): a reader is refused before any READ.
        await expect_error(grpc.StatusCode.FAILED_PRECONDITION, dw.pull("r1", [p], {"kv": [3, 4]}),
                           "no KV caches registered")  # fmt: skip
        assert p.metrics is not None
        assert p.metrics.registered_bytes._value.get() == 0
        successor = _spawn(harness, p, "successor", {"kv": lay})
        t0 = time.monotonic()
        await asyncio.to_thread(successor.recv, 60)  # registered, with no lease to wait out
        register_s = time.monotonic() - t0
        await asyncio.to_thread(successor.call, "prefill", "r2", {"kv": [5, 6]}, 2, 0)
        res = await dw.pull("r2", [p], {"kv": [7, 8]})
        assert dw.verify({"kv": [7, 8]}, 2) == (res.bytes, 0)
        assert res.bytes == 2 * lay.page_bytes * lay.num_layers
        assert _segments(victim.proc.pid) == []
        print(f"dead worker dropped after {elapsed * 1000:.0f} ms; successor registered in {register_s:.2f}s")
        successor.send("stop")
        await asyncio.to_thread(successor.recv, 30)
    finally:
        await watch.close()


async def test_a_decode_worker_killed_mid_pull_frees_the_publish_on_the_prefill_side(harness: Harness) -> None:
    lay = attention()
    p = await harness.sidecar(role="prefill", engine_id="prefill", lease_seconds=600)
    pw = await harness.worker(p, {"kv": lay})
    dp = DelayedDataPlane("decode-slow", 30.0)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    watch = AsyncClient(d.local_target)
    try:
        victim = _spawn(harness, d, "victim", {"kv": lay})
        await asyncio.to_thread(victim.recv, 60)
        await pw.prefill("r1", {"kv": [1, 2, 3]}, salt=4)
        victim.send("pull", "r1", [p.peer_address], {"kv": [4, 5, 6]}, 4, "prefill")
        await asyncio.wait_for(dp.reading.wait(), 30)  # its READ is in flight
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 10)

        async def settled() -> bool:
            s, ps = await watch.status(), await pw.client.status()
            return not s["registered"] and s["transfers_in_flight"] == 0 and ps["leases"] == 0

        # The pull was cancelled (nobody will use the bytes) and the publisher told to drop its copy.
        await _until(settled, NOTICE_BOUND_S + 2.0)
        assert _segments(victim.proc.pid) == []
    finally:
        await watch.close()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_prefill_worker_killed_before_publishing_fails_the_push_at_once(harness: Harness,
                                                                                 streamed: bool) -> None:  # fmt: skip
    """Push mode: the prefill worker dies while the decode side's offer waits for its publish (layer-wise:
    after some layers were already written). That publish can never come, so the reader is told at once,
    not at its deadline, and only after the layer WRITEs already started have stopped."""
    lay = attention(layers=4, block_size=16)
    p = await harness.sidecar(role="prefill", engine_id="prefill", lease_seconds=600)
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": lay})
    core = p.core
    assert core is not None
    assert p.metrics is not None
    victim = _spawn(harness, p, "victim", {"kv": lay})
    await asyncio.to_thread(victim.recv, 60)
    pull = asyncio.ensure_future(dw.pull("r1", [p], {"kv": [4, 5, 6]}, push=True, deadline=30.0,
                                         spans={"kv": TokenSpan(47, 0, 0)}))  # fmt: skip

    async def offered() -> bool:
        return bool(core.pusher.offers.get("r1"))

    await _until(offered, 30.0)
    if streamed:  # a layer every 0.3 s, each signalled to the sidecar; never published (it dies first)
        victim.send("produce", "r1", {"kv": [1, 2, 3]}, 4, 300, True, 1)

        async def some_layers_written() -> bool:
            return any(o.stream_bytes for o in core.pusher.offers.get("r1", {}).values())

        await _until(some_layers_written, 10.0)
    victim.proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    await asyncio.to_thread(victim.proc.wait, 10)
    err = await expect_error(grpc.StatusCode.ABORTED, pull, "stopped before it was published", "exited")
    assert err.reason == "ABORTED"
    assert time.monotonic() - t0 < NOTICE_BOUND_S
    assert not len(core.pusher)
    assert p.metrics.transfers.labels(direction="write", outcome="ok")._value.get() == 0


async def test_worker_lease_must_be_open(harness: Harness, tmp_path: Path) -> None:
    from kvxfer.fdpass import fd_socket_path, send_fds

    lay = attention()
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    w = await harness.worker(p, {"kv": lay}, register=False)
    groups = {"kv": (lay, w.buffers["kv"].ref())}
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, w.client.register_caches(groups, worker_lease="nope"),
                       "worker_lease: 'nope' is not an open lease")  # fmt: skip
    lease = await asyncio.to_thread(send_fds, fd_socket_path(p.local_target), [])
    await w.client.register_caches(groups, worker_lease=lease.handle)
    lease.close()  # the worker "exits": its registration goes
    await _until(lambda: _not_registered(w.client), NOTICE_BOUND_S)
    assert w.buffers["kv"].path.exists()  # the worker's own segment stays the worker's


async def _not_registered(c: AsyncClient) -> bool:
    return not (await c.status())["registered"]


async def test_a_decode_worker_killed_mid_push_revokes_its_offer(harness: Harness) -> None:
    """Push mode: the dead decode worker's blocks are gone, so the WRITE held in flight is revoked
    (cancelled before it is posted), and the prefill frees its publish at once."""
    lay = attention()
    wp = DelayedDataPlane("prefill-slow", 30.0)  # FAULT INJECTOR: holds the writer's WRITE
    p = await harness.sidecar(role="prefill", engine_id="prefill", lease_seconds=600, data_plane=wp)
    pw = await harness.worker(p, {"kv": lay})
    d = await harness.sidecar(role="decode", engine_id="decode")
    watch = AsyncClient(d.local_target)
    try:
        victim = _spawn(harness, d, "victim", {"kv": lay})
        await asyncio.to_thread(victim.recv, 60)
        victim.send("pull", "r1", [p.peer_address], {"kv": [4, 5, 6]}, 4, "prefill", None, True)
        core = p.core
        assert core is not None

        async def offered() -> bool:
            return bool(core.pusher.offers.get("r1"))

        await _until(offered, 30.0)
        await pw.prefill("r1", {"kv": [1, 2, 3]}, salt=4)
        await asyncio.wait_for(wp.reading.wait(), 30)  # the WRITE is in the data plane's hands
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 10)

        async def settled() -> bool:
            s, ps = await watch.status(), await pw.client.status()
            return (
                not s["registered"] and s["transfers_in_flight"] == 0 and ps["leases"] == 0 and not len(p.core.pusher)
            )  # type: ignore[union-attr]

        await _until(settled, NOTICE_BOUND_S + 2.0)
        assert p.metrics is not None
        assert p.metrics.transfers.labels(direction="write", outcome="ok")._value.get() == 0
    finally:
        await watch.close()


async def test_a_pull_aborted_before_its_task_first_runs_answers_aborted_at_once(harness: Harness) -> None:
    """The worker's Pull and its Abort handled in one loop turn: the pull's task is cancelled before its
    first step, so none of its own code runs; it must still end ABORTED at once, not at the worker's
    deadline (seen as a 20 s hang in tests/vllm_inproc under load)."""
    from kvxfer.errors import AbortedError
    from kvxfer.server.events import Kind
    from kvxfer.wire import local_pb2
    from kvxfer.wire.convert import blocks_to_proto

    lay = attention()
    ps, _pw, ds, _dw = await harness.deployment({"kv": lay}, {"kv": lay})
    core = ds[0].core
    assert core is not None
    req = local_pb2.PullRequest(request_id="early", remote_addresses=[ps[0].peer_address],
                                local_blocks=blocks_to_proto({"kv": [1]}), wait=True, timeout_seconds=20.0)  # fmt: skip
    t0 = time.monotonic()
    pull = asyncio.ensure_future(core.puller.pull(req, None))
    await asyncio.sleep(0)  # the Pull ran to its first await: registered, its task created but not yet run
    assert "early" in core.puller.pulls
    assert await core.puller.abort("early", "the worker gave up") is True
    with pytest.raises(AbortedError, match="aborted: the worker gave up"):
        await pull
    assert time.monotonic() - t0 < 2.0
    assert "early" not in core.puller.pulls  # a retry is not refused as already in flight
    (ev,) = [e for e in core.hub._ring if e.request_id == "early"]
    assert ev.kind == Kind.ABORTED
