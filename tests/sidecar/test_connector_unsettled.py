"""The vLLM connector's worker half with loads that failed unfenced (reason DATA_PLANE_UNFENCED), vLLM-free.

``WorkerSide`` asks a real in-process sidecar (or, as a FAULT INJECTOR, a socket that never answers) which of
those loads are still unsettled; ``finished()`` runs on a thread of its own, as vLLM calls it from its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import socket
import time

import grpc
import pytest

from kvxfer.client import PullResult
from kvxfer.errors import PeerUnavailableError, Reason
from kvxfer.integrations.vllm.params import RemoteGroup, RemotePrefill
from kvxfer.integrations.vllm.plan import GroupPull, PullSpec, StepPlan
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.unsettled import UNSETTLED_CHECK_SECONDS
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.topology import RankInfo
from tests.sidecar.helpers import DelayedDataPlane, Harness, agent_on, agent_reads, attention, expect_error

LAY = attention()


def _spec(rid: str, remote_id: str, blocks: tuple[int, ...]) -> PullSpec:
    remote = RemotePrefill(remote_id, "prefill", ("127.0.0.1:1",), (RemoteGroup("kv", (1, 2), 16),))
    return PullSpec(rid, remote, (GroupPull(0, blocks, (1, 2)),))


def _failed(exc: BaseException) -> cf.Future[PullResult]:
    fut: cf.Future[PullResult] = cf.Future()
    fut.set_exception(exc)
    return fut


async def test_loads_of_one_pulled_id_all_settle_and_an_aborted_one_names_no_blocks(harness: Harness) -> None:
    """Two vLLM requests whose loads failed unfenced are kept until the sidecar no longer names the pull
    unsettled. One was aborted while it waited: once reported, its blocks are not named as failed (vLLM
    frees them; they used to be named, as if it still held them)."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    dp = DelayedDataPlane("decode-conn", 30.0, unfenced=True, fence_seconds=0.2)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    pw, dw = await harness.worker(p, {"kv": LAY}), await harness.worker(d, {"kv": LAY})
    await pw.prefill("late", {"kv": [1, 2]}, salt=1)
    exc = await expect_error(grpc.StatusCode.DEADLINE_EXCEEDED, dw.pull("late", [p], {"kv": [3, 4]}, deadline=0.5),
                             "may still land")  # fmt: skip
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    w = WorkerSide(ConnectorSettings(sidecar_socket=d.settings.local_socket), rank=RankInfo(0, 1), local_rank=0,
                   block_errors=True)  # fmt: skip
    try:
        w._pulls["d-1"] = (_spec("d-1", "late", (3, 4)), _failed(exc))
        w._pulls["d-2"] = (_spec("d-2", "late", (5, 6)), _failed(exc))
        assert await asyncio.to_thread(w.finished) == (set(), set(), set())  # both kept: the READ may land
        w.on_step(StepPlan(aborts=["d-1"]))  # vLLM aborted d-1 meanwhile (it keeps the blocks until reported)
        await asyncio.sleep(2 * UNSETTLED_CHECK_SECONDS)  # the look-ups' pace
        assert await asyncio.to_thread(w.finished) == (set(), set(), set())
        dp.unfenced_ops[0].ended = True  # the data plane saw the READ end
        recving: set[str] = set()
        for _ in range(50):
            await asyncio.sleep(UNSETTLED_CHECK_SECONDS)
            _, got, _ = await asyncio.to_thread(w.finished)
            recving |= got
            if recving == {"d-1", "d-2"}:
                break
        assert recving == {"d-1", "d-2"}
        assert w.load_errors() == {5, 6}  # the aborted request's blocks are vLLM's to free, not failed
    finally:
        w.close()


def test_a_sidecar_that_does_not_answer_is_asked_less_and_less(caplog: pytest.LogCaptureFixture) -> None:
    """A sidecar that takes connections but never answers (FAULT INJECTOR: a listening socket nobody serves)
    costs ``finished()`` a look-up's deadline (1 s) each time it asks; the asking backs off as the lease
    look-ups do, instead of every 0.1 s (every engine step then took a second)."""
    path = f"/tmp/kx-silent-{time.monotonic_ns()}.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(path)
    silent.listen(64)
    w = WorkerSide(ConnectorSettings(sidecar_socket=path), rank=RankInfo(0, 1), local_rank=0)
    try:
        err = PeerUnavailableError("READ failed and may still land", reason=Reason.DATA_PLANE_UNFENCED)
        w._pulls["d-1"] = (_spec("d-1", "late", (3, 4)), _failed(err))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            while time.monotonic() - t0 < 3.5:
                assert w.finished() == (set(), set(), set())
                time.sleep(0.05)
        asked = sum("failed loads may still land" in r.getMessage() for r in caplog.records)
        assert 1 <= asked <= 2, f"asked a silent sidecar {asked} times in 3.5 s"
    finally:
        w.close()
        silent.close()


async def test_with_its_own_agent_a_load_is_kept_while_the_agent_may_still_land_it(harness: Harness) -> None:
    """``data_plane: worker``: the READs are the worker's own agent's, which outlives a sidecar restart (the
    new sidecar names nothing unsettled). A load that failed unfenced is kept while the agent still runs a
    transfer that started before the failure (FAULT INJECTOR: its data plane holds READs), and handed back
    once that transfer ended."""
    d = await harness.sidecar(role="decode", engine_id="decode")
    w = WorkerSide(ConnectorSettings(sidecar_socket=d.settings.local_socket), rank=RankInfo(0, 1), local_rank=0,
                   block_errors=True)  # fmt: skip
    agent = agent_on(DelayedDataPlane("conn-agent", 30.0))
    await agent_reads(agent, 1, timeout=30.0)
    w.agent = agent
    try:
        err = PeerUnavailableError("READ failed and may still land", reason=Reason.DATA_PLANE_UNFENCED)
        w._pulls["d-1"] = (_spec("d-1", "gone-with-the-old-sidecar", (3, 4)), _failed(err))
        for _ in range(5):  # the sidecar names nothing unsettled, but the agent's READ still runs
            assert await asyncio.to_thread(w.finished) == (set(), set(), set())
            await asyncio.sleep(UNSETTLED_CHECK_SECONDS)
        agent._transfers[1].cancel()  # the READ ends (fenced: the data plane holds no unfenced cancel here)
        await asyncio.gather(agent._transfers.get(1) or asyncio.sleep(0), return_exceptions=True)
        recving: set[str] = set()
        for _ in range(50):
            await asyncio.sleep(UNSETTLED_CHECK_SECONDS)
            recving |= (await asyncio.to_thread(w.finished))[1]
            if recving:
                break
        assert recving == {"d-1"}
        assert w.load_errors() == {3, 4}
    finally:
        w.agent = None
        agent.close()
        w.close()
