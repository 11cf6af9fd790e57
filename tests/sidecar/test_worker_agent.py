"""``--backend worker``: the worker's own NIXL agent moves the bytes, driven by its sidecar.

Real parts throughout: in-process sidecars on loopback, one real NIXL (UCX) agent per worker that
registered the worker's own buffers. The sidecars map no memory; the decode worker's agent READs
from the prefill worker's agent with the descriptors its sidecar planned.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.client import AsyncClient
from kvxfer.errors import FailedPreconditionError, Reason
from kvxfer.memory import LibraryRef
from kvxfer.topology import RegionTable
from kvxfer.transport import (
    TransferFailedError,
    TransferResult,
    TransferTimeoutError,
    TransferUnfencedError,
    TransportConfig,
    WorkerAgentInfo,
    cancelled_unfenced,
    create_transport,
    unfenced_op,
)
from kvxfer.transport import worker_agent as worker_agent_transport
from kvxfer.transport.worker_agent import WorkerAgentTransport, descriptors_from_bytes, descriptors_to_bytes
from kvxfer.wire import local_pb2
from kvxfer.worker_agent import WorkerAgent
from tests.sidecar.helpers import DelayedDataPlane, Harness, agent_on, agent_reads, attention, expect_error, transfer

LAY = attention()
HND = attention(heads=8, tp=2, layers=3, blocks=32, order="HND")


async def test_the_workers_agents_move_exact_bytes_and_the_sidecars_map_nothing(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, agent=True, backend="worker")
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [5, 6, 7, 30]}, {"kv": [9, 3, 4, 50]}, salt=11)
    assert res.done
    assert res.bytes == 4 * LAY.page_bytes * LAY.num_layers
    # Blocks 3,4 are one run on the decode side but 6,7 on the prefill side: 3 runs of
    # (9<-5), (3,4<-6,7), (50<-30) per layer, one descriptor each.
    assert res.descriptors == 3 * LAY.num_layers
    assert dw[0].agent is not None
    assert dw[0].agent.jobs_run == 1
    assert pw[0].agent is not None
    assert pw[0].agent.jobs_run == 0
    for sc in (*ps, *ds):
        assert isinstance(sc.core.dp, WorkerAgentTransport)  # no CUDA IPC shortcut, no library of its own
    # A second request on the same peer reuses the loaded agent.
    (res2,) = await transfer(pw, ps, dw, "r2", {"kv": [1]}, {"kv": [2]}, salt=12)
    assert res2.bytes == LAY.page_bytes * LAY.num_layers
    assert dw[0].agent.jobs_run == 2
    dp = ds[0].core.dp
    assert isinstance(dp, WorkerAgentTransport)
    assert dp._peer_loads == {}  # every load was answered: nothing tracked forever
    assert dp._pending == {}


async def test_heterogeneous_tp_through_the_workers_agents(harness: Harness) -> None:
    # Prefill TP 2 (4 heads each), decode TP 1 (8 heads): each decode READ takes head slices of
    # both prefill ranks' agents.
    ps, pw, _ds, dw = await harness.deployment(
        {"kv": HND}, {"kv": attention(heads=8, tp=1, layers=3, blocks=32, order="HND")},
        prefill_tp=2, agent=True, backend="worker",
    )  # fmt: skip
    (res,) = await transfer(pw, ps, dw, "h1", {"kv": [1, 2, 3]}, {"kv": [7, 8, 9]}, salt=5)
    assert res.done
    assert sorted(res.remote_ranks) == [0, 1]


async def test_registration_mismatches_are_refused_naming_worker_agent(harness: Harness) -> None:
    plain = await harness.sidecar(role="prefill", engine_id="plain")
    hosted = await harness.sidecar(role="prefill", engine_id="hosted", backend="worker")
    # An agent offered to a sidecar whose data plane runs in the sidecar.
    w = await harness.worker(plain, {"kv": LAY}, agent=True, register=False)
    exc = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, w.register(), "--backend worker", "nixl")
    assert (exc.field, exc.reason) == ("worker_agent", Reason.WRONG_BACKEND)
    # No agent, to a sidecar that needs one.
    w2 = await harness.worker(hosted, {"kv": LAY}, register=False)
    exc = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, w2.register(), "must register its agent")
    assert (exc.field, exc.reason) == ("worker_agent", Reason.WRONG_BACKEND)
    # An agent, but memory the sidecar would have to map (shared memory).
    w3 = await harness.worker(hosted, {"kv": LAY}, agent=True, register=False)
    assert w3.agent is not None
    w3.agent.register(LAY, w3.buffers["kv"].regions)
    groups = {"kv": (LAY, w3.buffers["kv"].ref())}
    exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                             w3.client.register_caches(groups, worker_agent=w3.agent.info()),
                             "groups[0].memory", "SharedMemoryRef")  # fmt: skip
    # Addresses of another process than the agent's.
    info = w3.agent.info()
    other = WorkerAgentInfo(info.backend, info.agent_name, info.metadata, info.pid + 1)
    lib = {"kv": (LAY, LibraryRef.from_arrays(w3.buffers["kv"].regions))}
    exc = await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        w3.client.register_caches(lib, worker_agent=other),
        f"belong to process {info.pid}",
        f"the worker's agent runs in process {info.pid + 1}",
    )
    assert exc.field == "groups[0].memory.library.pid"
    # A malformed agent: the field and value are named.
    bad = WorkerAgentInfo("worker", info.agent_name, info.metadata, info.pid)
    exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, w3.client.register_caches(lib, worker_agent=bad),
                             "worker_agent.backend", "'worker'")  # fmt: skip
    assert exc.field == "worker_agent.backend"
    # AgentJobs on a sidecar without a worker-hosted data plane.
    exc = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, AsyncClient(plain.local_target).agent_jobs(),
                             "AgentJobs", "(nixl) runs in the sidecar")  # fmt: skip
    assert (exc.field, exc.reason) == ("backend", Reason.WRONG_BACKEND)


async def test_agent_jobs_checks_its_fields(harness: Harness) -> None:
    _ps, _pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, agent=True, backend="worker")
    client = dw[0].client
    exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, client.agent_jobs(wait_seconds=99.0),
                             "wait_seconds: 99.0 is not in [0, 10]")  # fmt: skip
    assert exc.field == "wait_seconds"
    epoch = ds[0].core.registry.require().epoch
    exc = await expect_error(grpc.StatusCode.FAILED_PRECONDITION, client.agent_jobs(epoch=epoch + 1),
                             f"the agent serves registration {epoch + 1}, the sidecar holds {epoch}")  # fmt: skip
    assert (exc.field, exc.reason) == ("epoch", Reason.NOT_REGISTERED)
    assert await client.agent_jobs(epoch=epoch) == []  # nothing waits: answered at once


async def test_an_agent_that_stops_serving_fails_only_its_pull_and_comes_back(harness: Harness) -> None:
    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, agent=True, backend="worker")
    d = dw[0]
    assert d.agent is not None
    assert d._serving is not None
    d._serving.cancel()  # the decode worker's agent takes no more jobs
    await asyncio.gather(d._serving, return_exceptions=True)
    await pw[0].prefill("lost", {"kv": [1, 2]}, salt=3)
    exc = await expect_error(grpc.StatusCode.DEADLINE_EXCEEDED, d.pull("lost", ps, {"kv": [1, 2]}, deadline=1.0))
    assert exc.reason == Reason.DEADLINE
    # Serving again: the next request moves (the publish that failed is untouched on its side).
    d._serving = asyncio.ensure_future(d.agent.serve(d.client))
    (res,) = await transfer(pw, ps, dw, "back", {"kv": [3]}, {"kv": [4]}, salt=4)
    assert res.done


async def test_a_transfer_the_agent_fails_reports_its_reason() -> None:
    # The sidecar's side alone: an outcome's code, not its text, decides the error.
    t = create_transport("worker", "side", TransportConfig(fence_budget_s=0.2))
    assert isinstance(t, WorkerAgentTransport)
    t.bind_worker(WorkerAgentInfo("nixl", "w", b"md", 1))
    desc = np.array([[4096, 64, 0]], dtype=np.uint64)
    task, job = await _taken(t, desc)
    assert job.WhichOneof("kind") == "transfer"
    assert descriptors_from_bytes(job.transfer.local, "local").tolist() == [[4096, 64, 0]]
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="slow")])
    with pytest.raises(TransferTimeoutError, match="slow"):
        await task
    # An outcome the worker's agent reported unfenced stays unfenced (its reason, not its text, decides).
    task, job = await _taken(t, desc)
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                     reason=Reason.DATA_PLANE_UNFENCED.value, message="in flight")])  # fmt: skip
    with pytest.raises(TransferUnfencedError, match="in flight") as unfenced:
        await task
    assert unfenced.value.reason == Reason.DATA_PLANE_UNFENCED
    assert not unfenced.value.unfenced.ended
    assert t.unfenced_live() == 1
    t.report([local_pb2.AgentOutcome(id=job.id, ended=True)])  # the agent's late notice: the operation ended
    assert unfenced.value.unfenced.ended
    assert t.unfenced_live() == 0
    # A cancelled waiter tells the agent to give up the job it already took, and the cancel goes through
    # once the agent answers that it ended (within the fence budget).
    task, job = await _cancelled_while_taken(t, desc)
    assert not task.done()  # the agent's operation may still be running
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.CANCELLED.value[0], message="cancelled")])
    assert not cancelled_unfenced(await _cancel_raised(task))
    # No answer within the budget (0.2 s + 1 s for the report): the cancel says unfenced, watched until the
    # agent's notice comes.
    task, job = await _taken(t, desc)
    task.cancel()
    late = await _cancel_raised(task)
    assert cancelled_unfenced(late)
    op = unfenced_op(late)
    assert op is not None
    assert (op.op, op.peer, op.watched, op.ended) == ("READ", "peer", True, False)
    await t.next_jobs(0, 1.0)  # the cancel job
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.CANCELLED.value[0],
                                     reason=Reason.DATA_PLANE_UNFENCED.value)])  # fmt: skip
    assert not op.ended  # the agent's own fence ran out too
    t.report([local_pb2.AgentOutcome(id=job.id, ended=True)])
    assert op.ended
    # The worker going away fails what waits, with nothing left queued for the next one.
    task = asyncio.ensure_future(t.transfer("READ", desc, desc, "peer", timeout=5.0))
    await asyncio.sleep(0)
    t.bind_worker(None)
    with pytest.raises(TransferFailedError, match="'w' went away"):
        await task
    with pytest.raises(FailedPreconditionError, match="no worker agent") as refused:
        await t.next_jobs(0, 0.0)
    assert refused.value.reason is Reason.NOT_REGISTERED
    # Memory registered with no agent bound: a --backend worker sidecar whose worker brought none.
    with pytest.raises(FailedPreconditionError, match="registered no agent") as refused:
        t.register(RegionTable.for_layout(LAY, [4096 * (i + 1) for i in range(LAY.num_regions)]))
    assert (refused.value.field, refused.value.reason) == ("worker_agent", Reason.WRONG_BACKEND)
    assert descriptors_to_bytes(desc) == desc.astype("<u8").tobytes()


async def test_a_refused_re_registration_leaves_the_data_plane_to_the_registered_agent(harness: Harness) -> None:
    """A RegisterCaches with another agent whose groups are then refused bound the data plane to that agent
    first: the registration stayed the old one, but the sidecar's data plane now named the stranger's agent
    (its jobs queue cleared, its handshake metadata the stranger's), so the next reader loaded an agent
    that holds none of the worker's memory and every READ failed. Refused, it changes nothing."""
    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, agent=True, backend="worker")
    p = pw[0]
    dp = ps[0].core.dp
    assert isinstance(dp, WorkerAgentTransport)
    bound, metadata = dp.worker, dp.metadata()
    stranger = WorkerAgent()
    try:
        stranger.register(LAY, p.buffers["kv"].regions)
        groups = {"kv": (LAY, p.buffers["kv"].ref())}  # shared memory: refused for --backend worker
        exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                                 p.client.register_caches(groups, rank=p.rank, worker_agent=stranger.info()),
                                 "groups[0].memory")  # fmt: skip
        assert exc.field == "groups[0].memory"
    finally:
        stranger.close()
    assert (dp.worker, dp.metadata()) == (bound, metadata)
    # The first reader handshakes now, and reads from the worker's own agent.
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=7)
    assert res.done


async def _cancel_raised(task: asyncio.Task[object]) -> asyncio.CancelledError:
    """The CancelledError a cancelled task raised, as its own awaiter sees it (gather would make a new one)."""
    try:
        await task
    except asyncio.CancelledError as exc:
        return exc
    raise AssertionError("the task was not cancelled")


async def test_the_agent_answers_a_cancel_once_fenced_and_tells_when_an_unfenced_one_ended() -> None:
    """The worker's agent, told to cancel a transfer, answers with its outcome once its transport's fence is
    over (CANCELLED; reason DATA_PLANE_UNFENCED when the operation was still in flight), where it used to
    answer nothing; and once the operation ends it sends a late notice (``ended``), which is what lets the
    sidecar say the worker's blocks are safe again."""
    dp = DelayedDataPlane("agent-delayed", 30.0, unfenced=True, fence_seconds=0.1)  # FAULT INJECTOR (helpers)
    agent = agent_on(dp)
    await agent_reads(agent, 7)
    task = agent._transfers[7]
    agent._run(local_pb2.AgentJob(id=8, cancel=7))
    await asyncio.wait_for(asyncio.shield(task), 5)
    assert list(agent._outcomes) == [local_pb2.AgentOutcome(
        id=7, code=grpc.StatusCode.CANCELLED.value[0], reason=Reason.DATA_PLANE_UNFENCED.value, message="cancelled",
    )]  # fmt: skip
    agent._report_ended()
    assert len(agent._outcomes) == 1  # not ended yet: no notice
    dp.unfenced_ops[0].ended = True  # the data plane saw the operation end
    agent._report_ended()
    assert list(agent._outcomes)[1:] == [local_pb2.AgentOutcome(id=7, ended=True)]
    assert agent._watching == {}
    agent.close()


async def test_aclose_deregisters_only_once_the_cancelled_transfers_ended() -> None:
    """Closing the agent cancels its transfers and deregisters its memory only once each of them ended
    (its transport's fence, 0.3 s here): ``close()`` deregistered at once while the cancelled READ was
    still in flight, and the vLLM connector called it from another thread than the agent's loop."""
    dp = DelayedDataPlane("agent-closing", 30.0, unfenced=True, fence_seconds=0.3)  # FAULT INJECTOR (helpers)
    agent = agent_on(dp)
    regions = [np.zeros(LAY.region_bytes, dtype=np.uint8) for _ in range(LAY.num_regions)]
    agent.register(LAY, regions)
    await agent_reads(agent, 1, regions[0].ctypes.data)
    t0 = asyncio.get_running_loop().time()
    await agent.aclose()
    assert asyncio.get_running_loop().time() - t0 >= 0.3
    assert dp.in_flight_at_deregister == [0]  # nothing in flight when the memory went


async def test_an_ended_notice_that_comes_with_its_outcome_is_not_lost() -> None:
    """The agent's late notice (``ended``) can reach the sidecar in the same report as the unfenced outcome it
    follows (both queued before a report went out): the operation is then known to have ended. The notice
    used to be dropped (nothing watched the job yet), leaving the operation watched, and its pull unsettled,
    forever. A notice is never taken for an outcome: one that comes while the job still waits (its outcome
    lost on the way) does not make the transfer succeed."""
    t = create_transport("worker", "side", TransportConfig(fence_budget_s=0.2))
    assert isinstance(t, WorkerAgentTransport)
    t.bind_worker(WorkerAgentInfo("nixl", "w", b"md", 1))
    desc = np.array([[4096, 64, 0]], dtype=np.uint64)
    task, job = await _taken(t, desc)
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                     reason=Reason.DATA_PLANE_UNFENCED.value, message="in flight"),
              local_pb2.AgentOutcome(id=job.id, ended=True)])  # fmt: skip
    with pytest.raises(TransferUnfencedError, match="in flight") as unfenced:
        await task
    assert unfenced.value.unfenced.ended
    assert t.unfenced_live() == 0
    # The same for a cancel the agent answered unfenced, its notice in the same report.
    task, job = await _cancelled_while_taken(t, desc)
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.CANCELLED.value[0],
                                     reason=Reason.DATA_PLANE_UNFENCED.value, message="cancelled"),
              local_pb2.AgentOutcome(id=job.id, ended=True)])  # fmt: skip
    late = await _cancel_raised(task)
    op = unfenced_op(late)
    assert op is not None
    assert op.ended
    assert t.unfenced_live() == 0
    # A notice alone is no outcome: the transfer still waits for one.
    task, job = await _taken(t, desc)
    t.report([local_pb2.AgentOutcome(id=job.id, ended=True)])
    await asyncio.sleep(0.05)
    assert not task.done()
    t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.UNAVAILABLE.value[0], message="broke")])
    with pytest.raises(TransferFailedError, match="broke"):
        await task


async def test_a_restarted_sidecar_takes_no_late_notice_of_the_old_one_for_its_own_job() -> None:
    """The worker's agent outlives a sidecar restart: its late notice (``ended``) for a job of the old sidecar
    reaches the new one. Job ids started at 1 in every sidecar, so the notice named a job of the new one and
    marked that job's operation ended while it may still land (its pull no longer unsettled, its blocks
    reused); ids are now unique across sidecar processes."""
    desc = np.array([[4096, 64, 0]], dtype=np.uint64)
    outcomes: list[int] = []
    for name in ("old", "new"):
        t = create_transport("worker", name, TransportConfig(fence_budget_s=0.2))
        assert isinstance(t, WorkerAgentTransport)
        t.bind_worker(WorkerAgentInfo("nixl", "w", b"md", 1))
        task = asyncio.ensure_future(t.transfer("READ", desc, desc, "peer", timeout=5.0))
        (job,) = await t.next_jobs(0, 1.0)
        t.report([local_pb2.AgentOutcome(id=job.id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                         reason=Reason.DATA_PLANE_UNFENCED.value, message="in flight")])  # fmt: skip
        with pytest.raises(TransferUnfencedError) as unfenced:
            await task
        outcomes.append(job.id)
    assert outcomes[0] != outcomes[1]
    t.report([local_pb2.AgentOutcome(id=outcomes[0], ended=True)])  # the old sidecar's job ended
    assert not unfenced.value.unfenced.ended
    assert t.unfenced_live() == 1


async def test_the_sidecar_forgets_jobs_the_agent_never_answered_and_caps_what_it_watches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs given up on whose outcome never comes are forgotten after FORGET_GIVEN_UP_S (they stayed forever),
    and at most MAX_WATCHED unfenced jobs are watched: the oldest is let go, no longer watched."""
    monkeypatch.setattr(worker_agent_transport, "MAX_WATCHED", 2)
    t = create_transport("worker", "side", TransportConfig(fence_budget_s=0.0))
    assert isinstance(t, WorkerAgentTransport)
    t.bind_worker(WorkerAgentInfo("nixl", "w", b"md", 1))
    desc = np.array([[4096, 64, 0]], dtype=np.uint64)
    ops = []
    for _ in range(3):  # each times out without an outcome: unfenced, watched
        task = asyncio.ensure_future(t.transfer("READ", desc, desc, "peer", timeout=0.01))
        await t.next_jobs(0, 1.0)
        with pytest.raises(TransferUnfencedError) as err:
            await task
        ops.append(err.value.unfenced)
        await t.next_jobs(0, 1.0)  # the cancel job
    assert [op.watched for op in ops] == [False, True, True]
    assert t.unfenced_live() == 2
    assert len(t._pending) == 3
    monkeypatch.setattr(worker_agent_transport, "FORGET_GIVEN_UP_S", 0.0)
    task = asyncio.ensure_future(t.transfer("READ", desc, desc, "peer", timeout=5.0))
    await asyncio.sleep(0)
    assert len(t._pending) == 1  # only the new job's
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_agent_is_quiet_since_a_time_once_what_started_before_it_ended() -> None:
    """What the vLLM connector asks before it hands back a load that failed unfenced in --backend worker mode (a
    restarted sidecar knows nothing of the agent's READs): a transfer that started before the time and still
    runs, or one reported unfenced and not yet seen to end, keeps the agent from being quiet."""
    dp = DelayedDataPlane("agent-quiet", 30.0, unfenced=True, fence_seconds=0.1)  # FAULT INJECTOR (helpers)
    agent = agent_on(dp)
    await agent_reads(agent, 3)
    before, after = time.monotonic() - 60, time.monotonic() + 60
    assert agent.quiet_since(before)  # it started after that
    assert not agent.quiet_since(after)  # still running
    task = agent._transfers[3]
    agent._run(local_pb2.AgentJob(id=4, cancel=3))
    await asyncio.wait_for(asyncio.shield(task), 5)
    assert not agent.quiet_since(after)  # ended its task unfenced: its READ may still land
    dp.unfenced_ops[0].ended = True
    agent._report_ended()
    assert agent.quiet_since(after)
    agent.close()


async def _taken(
    t: WorkerAgentTransport, desc: npt.NDArray[np.uint64]
) -> tuple[asyncio.Task[TransferResult], local_pb2.AgentJob]:
    """A READ of ``desc`` handed to the worker's agent, and the job the agent took for it."""
    task = asyncio.ensure_future(t.transfer("READ", desc, desc, "peer", timeout=5.0))
    (job,) = await t.next_jobs(0, 1.0)
    return task, job


async def _cancelled_while_taken(
    t: WorkerAgentTransport, desc: npt.NDArray[np.uint64]
) -> tuple[asyncio.Task[TransferResult], local_pb2.AgentJob]:
    """As :func:`_taken`, then its waiter cancelled: the agent is told to give the job up."""
    task, job = await _taken(t, desc)
    task.cancel()
    (cancel,) = await t.next_jobs(0, 1.0)
    assert cancel.cancel == job.id
    return task, job
