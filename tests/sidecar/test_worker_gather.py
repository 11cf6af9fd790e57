"""The worker moving a pull's bytes itself (PullRequest.worker_gather, kvxfer.client.gather).

Two real sidecars, real NIXL agents and real shared-memory caches; what cannot run on this CPU
machine is replaced by two named FAKES: ``HostGatherPlane`` stands in for the same-host CUDA IPC
shortcut's ``same_host_gather`` (its one "allocation" is this process's address space, where the
publisher's shared memory is mapped too), and ``MemmoveDriver`` for the GPU gather (one host
memmove per span). Everything between them is the real protocol: the Pull answered with the
gather, the worker's launch and deadline check, GatherDone, the pull's outcome and the publisher's
notice.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer import cuda_ipc
from kvxfer.client import Client, KvxferRpcError
from kvxfer.client import gather as gather_module
from kvxfer.client.gather import MAX_SOURCE_SETS, WorkerGather
from kvxfer.errors import Reason
from kvxfer.server.app import Sidecar
from kvxfer.server.core import SidecarCore
from kvxfer.transport import (
    MemType,
    SameHostGather,
)
from kvxfer.wire import common_pb2, local_pb2
from tests.sidecar.helpers import DelayedDataPlane, Harness, Worker, attention

LAY = attention(layers=3, blocks=16)
U64 = np.uint64


class HostGatherPlane(DelayedDataPlane):
    """FAKE same-host gather capability around a real NIXL agent (the harness's delegating plane,
    with no delay): every READ it is asked to plan is handed to the worker."""

    def __init__(self) -> None:
        super().__init__("d-agent", 0.0)
        self.handed = 0

    @property
    def reads(self) -> int:
        """READs the sidecar's data plane moved itself."""
        return len(self.landed_at)

    def same_host_gather(
        self, peer: str, local: Any, remote: Any, *, mem_type: MemType, remote_mem_type: MemType
    ) -> SameHostGather:
        self.handed += 1
        # One source, "allocation" 0 of this process: the offset is the publisher's own address.
        return SameHostGather(b"\x01" * cuda_ipc.HANDLE_BYTES, ("host",), np.zeros(len(remote), U64),
                              remote[:, 0].astype(U64))  # fmt: skip


class MemmoveDriver:
    """FAKE GPU gather: each span moved by one host memmove, ``delay`` seconds before it ends."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.launches: list[int] = []
        self.events: list[str] = []  # "rehearse" / "launch", in order
        self.rehearse_error: cuda_ipc.CudaIpcError | None = None

    def rehearse(self, ordinal: int) -> None:
        self.events.append("rehearse")
        if self.rehearse_error is not None:
            raise self.rehearse_error

    def copy_async(self, ordinal: int, dst: Any, src: Any, sizes: Any, *, kernel: bool = False) -> Any:
        for d, s, z in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, z)
        time.sleep(self.delay)
        self.launches.append(len(sizes))
        self.events.append("launch")
        return cuda_ipc.CopyBatch(ordinal, len(self.launches), 1, "kernel" if kernel else "copy-engine")

    def done(self, batch: Any) -> bool:
        return True

    def wait(self, batch: Any) -> None:
        pass


class HostWorkerGather(WorkerGather):
    """The real executor, with the one "allocation" of HostGatherPlane mapped at address 0."""

    def _map(self, handle: bytes, device_uuid: str) -> tuple[int, int]:
        assert (handle, device_uuid) == (b"\x01" * cuda_ipc.HANDLE_BYTES, "host")
        return self.device, 0


async def eventually(cond: Any, timeout: float = 3.0) -> None:
    """Until ``cond()`` holds (what a peer's notice does happens off the answering call's path)."""
    until = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < until, "condition never held"
        await asyncio.sleep(0.01)


def core(sc: Sidecar) -> SidecarCore:
    assert sc.core is not None
    return sc.core


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> MemmoveDriver:
    drv = MemmoveDriver()
    monkeypatch.setattr(cuda_ipc, "driver", lambda: drv)
    return drv


async def _pair(harness: Harness) -> tuple[Sidecar, Worker, Sidecar, Worker, HostGatherPlane]:
    ps = await harness.sidecar("p", role="prefill", engine_id="prefill")
    plane = HostGatherPlane()
    ds = await harness.sidecar("d", role="decode", engine_id="decode", data_plane=plane)
    return ps, await harness.worker(ps, {"kv": LAY}), ds, await harness.worker(ds, {"kv": LAY}), plane


def _gather(w: Worker, *, warm_up: bool = True) -> HostWorkerGather:
    return HostWorkerGather(0, w.buffers["kv"].addresses, warm_up=warm_up)


@pytest.mark.parametrize("ids_given", [False, True], ids=["after-lookup", "reading-ahead"])
async def test_the_worker_moves_the_pull_itself_and_the_publisher_is_told(
    harness: Harness, driver: MemmoveDriver, ids_given: bool
) -> None:
    ps, pw, ds, dw, plane = await _pair(harness)
    p_ids, d_ids = [3, 4, 5, 9, 12], [15, 0, 1, 2, 7]
    await pw.prefill("r1", {"kv": p_ids}, salt=11)
    dw.poison({"kv": d_ids})
    res = await dw.pull("r1", [ps], {"kv": d_ids}, gather=_gather(dw),
                        remote_blocks={"kv": p_ids} if ids_given else None)  # fmt: skip
    checked, bad = dw.verify({"kv": d_ids}, 11)
    assert (checked, bad) == (len(d_ids) * LAY.page_bytes * LAY.num_layers, 0)
    assert res.done
    assert res.bytes == checked
    if ids_given:
        # Reading ahead of the lookup: the READ is the sidecar's (it overlaps the lookup).
        assert (plane.handed, plane.reads, len(driver.launches)) == (0, 1, 0)
    else:
        # One gather, launched by the worker; no READ by the sidecar's data plane.
        assert (plane.handed, plane.reads, len(driver.launches)) == (1, 0, 1)
        assert driver.launches[0] == res.descriptors
    # The pull ended on the decode side and the publisher dropped the publish on its notice.
    await eventually(lambda: not core(ds).puller.pulls and not core(ds).puller.steps.worker.waiting)
    await eventually(lambda: "r1" not in core(ps).publisher.publishes)


async def test_the_blocking_client_posts_its_report_on_its_own_connection(
    harness: Harness, driver: MemmoveDriver
) -> None:
    ps, pw, ds, dw, plane = await _pair(harness)
    blocking = Client(ds.local_target, timeout=30.0)
    gather = _gather(dw)
    try:
        for n, (p_ids, d_ids) in enumerate((([1, 2, 3], [4, 5, 6]), ([7], [8]))):
            rid = f"b{n}"
            await pw.prefill(rid, {"kv": p_ids}, salt=20 + n)
            res = await asyncio.to_thread(blocking.pull, rid, [ps.peer_address], {"kv": d_ids}, gather=gather)
            assert res.done
            assert dw.verify({"kv": d_ids}, 20 + n) == (len(d_ids) * LAY.page_bytes * LAY.num_layers, 0)
            assert set(gather.last) == {"answer", "plan", "launch", "wait"}
            # The report went as a frame of this thread's connection, answered after the call returned:
            # the pull ends on both sides all the same.
            await eventually(lambda rid=rid: rid not in core(ps).publisher.publishes)  # type: ignore[misc]
        assert plane.handed == 2
        assert plane.reads == 0
        assert blocking._thread_calls.active
    finally:
        await asyncio.to_thread(blocking.close)


class UnmappableWorkerGather(WorkerGather):
    """FAKE fault: this process cannot map the publisher's allocation (what the same process, or no
    peer access, gives cuIpcOpenMemHandle)."""

    def _map(self, handle: bytes, device_uuid: str) -> tuple[int, int]:
        raise cuda_ipc.CudaIpcError("cuIpcOpenMemHandle: CUDA_ERROR_INVALID_CONTEXT (invalid device context)", code=201)


async def test_a_gather_the_worker_cannot_start_is_moved_by_the_sidecar(
    harness: Harness, driver: MemmoveDriver
) -> None:
    ps, pw, _ds, dw, plane = await _pair(harness)
    gather = UnmappableWorkerGather(0, dw.buffers["kv"].addresses)
    for n, (p_ids, d_ids) in enumerate((([1, 2], [3, 4]), ([5], [6]))):
        rid = f"u{n}"
        await pw.prefill(rid, {"kv": p_ids}, salt=30 + n)
        res = await dw.pull(rid, [ps], {"kv": d_ids}, gather=gather)
        assert res.done
        assert dw.verify({"kv": d_ids}, 30 + n) == (len(d_ids) * LAY.page_bytes * LAY.num_layers, 0)
    # The first pull was handed over, the worker could not start it and the sidecar READ it; the
    # worker asks no more (its gathers would fail the same way), so the second went the usual way.
    assert (plane.handed, plane.reads) == (1, 2)
    assert driver.launches == []
    assert not gather.usable
    assert "CUDA_ERROR_INVALID_CONTEXT" in gather.unusable


async def test_a_gather_past_its_deadline_fails_the_pull_on_both_sides(harness: Harness, driver: MemmoveDriver) -> None:
    ps, pw, ds, dw, _plane = await _pair(harness)
    await pw.prefill("late", {"kv": [1, 2]}, salt=3)
    driver.delay = 0.6
    with pytest.raises(KvxferRpcError) as err:
        await dw.pull("late", [ps], {"kv": [4, 5]}, gather=_gather(dw), deadline=0.4)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.field == "timeout_seconds"
    assert "after the deadline" in str(err.value)
    # The sidecar failed the pull too (never a success) and told the publisher, which holds no more.
    await eventually(lambda: not core(ds).puller.pulls)
    await eventually(lambda: "late" not in core(ps).publisher.publishes)
    # Other pulls are unharmed.
    driver.delay = 0.0
    await pw.prefill("next", {"kv": [6]}, salt=4)
    await dw.pull("next", [ps], {"kv": [8]}, gather=_gather(dw))
    assert dw.verify({"kv": [8]}, 4)[1] == 0


@pytest.mark.parametrize("how", ["batch", "no-wait"])
async def test_a_pull_nobody_waits_on_is_moved_by_the_sidecar(
    harness: Harness, driver: MemmoveDriver, how: str
) -> None:
    # A PullBatch item, or a Pull without wait, has no caller to hand a gather to: the sidecar
    # moves its bytes itself, whatever worker_gather says.
    ps, pw, ds, dw, plane = await _pair(harness)
    await pw.prefill("q", {"kv": [1, 2]}, salt=8)
    req = local_pb2.PullRequest(request_id="q", remote_addresses=[ps.peer_address], wait=how == "batch",
                                worker_gather=True,
                                local_blocks=[common_pb2.BlockList(group="kv", block_ids=[9, 10])])  # fmt: skip
    if how == "batch":
        batch = await dw.client._call(dw.client._stub.PullBatch, local_pb2.PullBatchRequest(pulls=[req]), 10.0)
        (result,) = batch.results
        assert result.code == 0, result.message
        assert result.response.done
        assert not result.response.HasField("gather")
    else:
        answer = await dw.client._call(dw.client._stub.Pull, req, 10.0)
        assert not answer.HasField("gather")
        await eventually(lambda: not core(ds).puller.pulls)
    assert dw.verify({"kv": [9, 10]}, 8) == (2 * LAY.page_bytes * LAY.num_layers, 0)
    assert plane.handed == 0
    assert plane.reads == 1
    assert driver.launches == []


async def test_a_report_for_no_waiting_pull_is_not_found(harness: Harness, driver: MemmoveDriver) -> None:
    _ps, _pw, _ds, dw, _plane = await _pair(harness)
    with pytest.raises(KvxferRpcError) as err:
        await dw.client.gather_done(local_pb2.GatherDoneRequest(ticket=12345, ok=True, ended=time.monotonic()))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    # Not NOT_PUBLISHED ("no publish under that id"): the ticket names no waiting gather.
    assert (err.value.field, err.value.reason) == ("ticket", Reason.UNKNOWN_TICKET)


async def test_a_worker_that_never_reports_times_the_pull_out(harness: Harness, driver: MemmoveDriver) -> None:
    ps, pw, ds, dw, _plane = await _pair(harness)
    await pw.prefill("silent", {"kv": [1]}, salt=5)
    req = local_pb2.PullRequest(request_id="silent", remote_addresses=[ps.peer_address], wait=True,
                                timeout_seconds=0.5, worker_gather=True,
                                local_blocks=[common_pb2.BlockList(group="kv", block_ids=[2])])  # fmt: skip
    answer = await dw.client._call(dw.client._stub.Pull, req, 5.0)
    assert answer.HasField("gather")
    assert not answer.done
    spans = np.frombuffer(answer.gather.spans, dtype="<u8").reshape(-1, 5)
    assert spans[:, 4].sum() == LAY.page_bytes * LAY.num_layers  # one block of every layer
    assert set(spans[:, 2].tolist()) <= set(range(LAY.num_regions))
    await eventually(lambda: not core(ds).puller.pulls, timeout=5.0)
    with pytest.raises(KvxferRpcError) as err:  # too late: the pull has timed out
        await dw.client.gather_done(local_pb2.GatherDoneRequest(ticket=answer.gather.ticket, ok=True,
                                                                ended=time.monotonic()))  # fmt: skip
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.NOT_FOUND, Reason.UNKNOWN_TICKET)


async def _event(w: Worker, rid: str, kind: str) -> Any:
    """The first completion event of ``kind`` for ``rid`` on ``w``'s sidecar (replayed)."""

    async def first() -> Any:
        async for ev in w.client.watch_completions(replay=True):
            if (ev.request_id, ev.kind) == (rid, kind):
                return ev
        raise AssertionError("the stream ended")

    return await asyncio.wait_for(first(), 5.0)


async def test_a_report_with_no_usable_end_time_is_no_success(harness: Harness, driver: MemmoveDriver) -> None:
    """A GatherDone with ok=True whose ``ended`` is NaN, unset (0), infinite or before the gather was handed
    out passed the deadline check (``ended > deadline`` is false for all but inf) and the pull counted as a
    success, its publisher told DONE. Such a report fails the pull: INVALID_ARGUMENT naming ``ended`` and
    the value, the publisher told FAILED, and the next pull is unharmed."""
    ps, pw, ds, dw, _plane = await _pair(harness)
    for n, ended in enumerate((math.nan, 0.0, -1.0, 1.0, math.inf)):
        rid = f"e{n}"
        await pw.prefill(rid, {"kv": [1]}, salt=n)
        req = local_pb2.PullRequest(request_id=rid, remote_addresses=[ps.peer_address], wait=True,
                                    timeout_seconds=5.0, worker_gather=True,
                                    local_blocks=[common_pb2.BlockList(group="kv", block_ids=[2])])  # fmt: skip
        answer = await dw.client._call(dw.client._stub.Pull, req, 10.0)
        assert answer.HasField("gather")
        report = local_pb2.GatherDoneRequest(ticket=answer.gather.ticket, ok=True, launched=True, ended=ended)
        with pytest.raises(KvxferRpcError) as err:
            await dw.client.gather_done(report)
        assert (err.value.code, err.value.reason, err.value.field) == (
            grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_FIELD, "ended"), err.value  # fmt: skip
        assert f"ended at {ended!r}" in err.value.details
        assert (await _event(dw, rid, "PULL_FAILED")).code == grpc.StatusCode.INVALID_ARGUMENT
        released = await _event(pw, rid, "RELEASED")
        assert released.code != grpc.StatusCode.OK, released  # told FAILED, not DONE
    await eventually(lambda: not core(ds).puller.pulls and not core(ds).puller.steps.worker.waiting)
    await pw.prefill("good", {"kv": [6]}, salt=4)
    assert (await dw.pull("good", [ps], {"kv": [8]}, gather=_gather(dw))).done
    assert dw.verify({"kv": [8]}, 4)[1] == 0


async def test_without_the_capability_the_sidecar_moves_the_bytes(harness: Harness, driver: MemmoveDriver) -> None:
    ps, pws, _ds, dws = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await pws[0].prefill("plain", {"kv": [1, 2]}, salt=6)
    res = await dws[0].pull("plain", ps, {"kv": [3, 4]}, gather=_gather(dws[0]))
    assert res.done
    assert dws[0].verify({"kv": [3, 4]}, 6)[1] == 0
    assert driver.launches == []  # NIXL moved it; the worker launched nothing


def test_the_executor_refuses_spans_it_cannot_place(driver: MemmoveDriver) -> None:
    g = HostWorkerGather(0, [0x1000, 0x2000])
    one = b"\x01" * cuda_ipc.HANDLE_BYTES
    far = time.monotonic() + 60

    def plan(rows: list[list[int]], raw: bytes | None = None, handles: bytes = one) -> local_pb2.WorkerGather:
        spans = raw if raw is not None else np.array(rows, dtype="<u8").tobytes()
        return local_pb2.WorkerGather(ticket=1, source_handles=handles, source_devices=["host"], spans=spans,
                                      deadline=far)  # fmt: skip

    for p, want in ((plan([], b"\0" * 41), "not a whole number of 40-byte spans"),
                    (plan([[1, 0, 0, 0, 8]]), "source 1 of 1"),
                    (plan([[0, 0, 2, 0, 8]]), "region 2, but this worker registered 2 regions"),
                    (plan([[0, 0, 0, 0, 8]], handles=one + b"\x02"), "65 bytes for 1 source_devices")):  # fmt: skip
        out = g.run(p)
        assert not out.ok, out
        assert want in out.error, out
    assert driver.launches == []


class CountingWorkerGather(WorkerGather):
    """The real executor over host memory: each handle's "allocation" is a buffer of its own, and
    what is mapped and unmapped is recorded (the mappings are cuda_ipc's, which need a GPU)."""

    def __init__(self, regions: list[int]) -> None:
        super().__init__(0, regions)
        self.buffers: dict[bytes, ctypes.Array[ctypes.c_char]] = {}
        self.mapped: list[bytes] = []
        self.unmapped: list[bytes] = []

    def _map(self, handle: bytes, device_uuid: str) -> tuple[int, int]:
        self.mapped.append(handle)
        buf = self.buffers.setdefault(handle, ctypes.create_string_buffer(handle[:1] * 64))
        return self.device, ctypes.addressof(buf)

    def _unmap(self, key: tuple[int, bytes]) -> None:
        self.unmapped.append(key[1])


def test_the_executor_keeps_only_the_recent_publishers_mapped(driver: MemmoveDriver) -> None:
    dst = ctypes.create_string_buffer(64)
    g = CountingWorkerGather([ctypes.addressof(dst)])
    far = time.monotonic() + 60

    def pull_from(n: int) -> None:
        handle = bytes([n]) * cuda_ipc.HANDLE_BYTES
        spans = np.array([[0, 0, 0, 0, 8]], dtype="<u8").tobytes()
        out = g.run(local_pb2.WorkerGather(ticket=n, source_handles=handle, source_devices=["host"], spans=spans,
                                           deadline=far))  # fmt: skip
        assert out.ok, out
        assert dst.raw[:8] == bytes([n]) * 8  # the bytes came from this publisher's allocation

    def h(n: int) -> bytes:
        return bytes([n]) * cuda_ipc.HANDLE_BYTES

    for n in range(1, MAX_SOURCE_SETS + 1):
        pull_from(n)
    pull_from(1)  # used again: the most recent now, mapped once
    assert g.mapped == [h(n) for n in range(1, MAX_SOURCE_SETS + 1)]
    assert g.unmapped == []
    pull_from(MAX_SOURCE_SETS + 1)  # one more publisher: the least recently used (2) goes
    assert g.unmapped == [h(2)]
    pull_from(2)  # a publisher that comes back is mapped again
    assert g.mapped[-1] == h(2)
    assert g.unmapped == [h(2), h(3)]
    g.close()
    assert sorted(g.unmapped[2:]) == sorted(h(n) for n in [1, 2, *range(4, MAX_SOURCE_SETS + 2)])
    assert len(g.unmapped) == len(g.mapped)  # every mapping given back exactly once


def test_a_publisher_dropped_while_a_gather_copies_from_it_is_unmapped_after(
    driver: MemmoveDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gather_module, "MAX_SOURCE_SETS", 1)
    dst = ctypes.create_string_buffer(64)
    g = CountingWorkerGather([ctypes.addressof(dst)])
    spans = np.array([[0, 0, 0, 0, 8]], dtype="<u8").tobytes()
    a, b = b"\x0a" * cuda_ipc.HANDLE_BYTES, b"\x0b" * cuda_ipc.HANDLE_BYTES

    def plan(handle: bytes) -> local_pb2.WorkerGather:
        return local_pb2.WorkerGather(ticket=1, source_handles=handle, source_devices=["host"], spans=spans,
                                      deadline=time.monotonic() + 60)  # fmt: skip

    seen: list[list[bytes]] = []
    copy = driver.copy_async

    def copy_then_another_thread_pulls(*args: Any, **kw: Any) -> Any:
        batch = copy(*args, **kw)
        if len(driver.launches) == 1:  # while A's copies run, another gather maps B, which pushes A out
            assert g.run(plan(b)).ok
            seen.append(list(g.unmapped))
        return batch

    monkeypatch.setattr(driver, "copy_async", copy_then_another_thread_pulls)
    assert g.run(plan(a)).ok
    assert seen == [[]]  # A was still being copied from: kept mapped
    assert g.unmapped == [a]  # then given back, once
    g.close()
    assert g.unmapped == [a, b]


async def test_a_long_gather_is_waited_for_off_the_event_loop(
    driver: MemmoveDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies that outlast the spin are waited for on a worker thread: the loop serves meanwhile."""
    waited_on: list[str] = []

    def not_done_yet(batch: Any) -> bool:
        return False

    def slow_wait(batch: Any) -> None:
        waited_on.append(threading.current_thread().name)
        time.sleep(0.3)

    monkeypatch.setattr(driver, "done", not_done_yet)
    monkeypatch.setattr(driver, "wait", slow_wait)
    dst = ctypes.create_string_buffer(64)
    g = CountingWorkerGather([ctypes.addressof(dst)])
    spans = np.array([[0, 0, 0, 0, 8]], dtype="<u8").tobytes()
    plan = local_pb2.WorkerGather(ticket=1, source_handles=b"\x07" * cuda_ipc.HANDLE_BYTES, source_devices=["host"],
                                  spans=spans, deadline=time.monotonic() + 60)  # fmt: skip
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        out = await g.run_async(plan)
    finally:
        ticker.cancel()
    assert out.ok, out
    assert dst.raw[:8] == b"\x07" * 8
    assert len(waited_on) == 1
    assert waited_on[0] != threading.current_thread().name  # not the loop's thread
    assert ticks >= 10  # the loop ran through the 0.3 s wait
    assert g.last["wait"] >= 0.3e6
    g.close()
    assert g.unmapped == [b"\x07" * cuda_ipc.HANDLE_BYTES]


@pytest.mark.parametrize("client", ["aio", "blocking"])
@pytest.mark.parametrize("warm_up", [True, False], ids=["warm-up", "no-warm-up"])
async def test_a_worker_warms_its_gather_while_the_answer_is_on_its_way(
    harness: Harness, driver: MemmoveDriver, client: str, warm_up: bool
) -> None:
    """One rehearsal per pull that may be handed a gather, before the gather's launch; none when
    turned off or for a pull that asks for no gather; the bytes are the same either way."""
    ps, pw, ds, dw, plane = await _pair(harness)
    gather = _gather(dw, warm_up=warm_up)
    blocking = Client(ds.local_target, timeout=30.0)
    try:
        for n, (p_ids, d_ids) in enumerate((([1, 2, 3], [4, 5, 6]), ([7], [8]))):
            rid = f"w{n}"
            await pw.prefill(rid, {"kv": p_ids}, salt=40 + n)
            if client == "aio":
                res = await dw.pull(rid, [ps], {"kv": d_ids}, gather=gather)
            else:
                dw.poison({"kv": d_ids})
                res = await asyncio.to_thread(blocking.pull, rid, [ps.peer_address], {"kv": d_ids}, gather=gather)
            assert res.done
            assert dw.verify({"kv": d_ids}, 40 + n) == (len(d_ids) * LAY.page_bytes * LAY.num_layers, 0)
        assert driver.events == (["rehearse", "launch"] * 2 if warm_up else ["launch"] * 2)
        assert plane.handed == 2
        # A pull that asks for no gather warms nothing.
        await pw.prefill("plain", {"kv": [9]}, salt=50)
        assert (await dw.pull("plain", [ps], {"kv": [10]})).done
        assert driver.events == (["rehearse", "launch"] * 2 if warm_up else ["launch"] * 2)
    finally:
        await asyncio.to_thread(blocking.close)


async def test_a_failed_warm_up_changes_nothing_but_itself(
    harness: Harness, driver: MemmoveDriver, caplog: pytest.LogCaptureFixture
) -> None:
    """FAKE fault: the rehearsal's driver call fails. The pull moves its bytes all the same, and the
    worker warms up no more (one warning)."""
    ps, pw, _ds, dw, plane = await _pair(harness)
    driver.rehearse_error = cuda_ipc.CudaIpcError("cuMemAlloc(rehearsal): CUDA_ERROR_OUT_OF_MEMORY", code=2)
    gather = _gather(dw)
    for n, (p_ids, d_ids) in enumerate((([1, 2], [3, 4]), ([5], [6]))):
        await pw.prefill(f"f{n}", {"kv": p_ids}, salt=60 + n)
        res = await dw.pull(f"f{n}", [ps], {"kv": d_ids}, gather=gather)
        assert res.done
        assert dw.verify({"kv": d_ids}, 60 + n) == (len(d_ids) * LAY.page_bytes * LAY.num_layers, 0)
    assert driver.events == ["rehearse", "launch", "launch"]
    assert plane.handed == 2
    assert not gather.warm
    assert gather.usable
    assert [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()] == [
        "a gather's warm-up failed; pulls go on without it"
    ]


def test_spans_in_the_tail_of_the_longer_of_two_groups_at_one_base_are_placed() -> None:
    """Block-major groups of one allocation are registered at one base with different sizes: a span
    past the shorter one's end lies in the longer one (it was refused as a planning bug)."""
    from kvxfer.server.worker_gathers import _Regions, _worker_regions
    from kvxfer.topology import RegionIndex

    base, block = 1 << 32, 16384
    regions = _Regions(1, RegionIndex.of([base, base], [8 * block, 7 * block + 8192]))
    local = np.array([[base + 7 * block, block, 0], [base + block, block, 0]], dtype=U64)
    region, offset = _worker_regions(regions, local)
    assert region.tolist() == [0, 0]  # the region that holds both; one base, so the same offsets
    assert offset.tolist() == [7 * block, block]
    with pytest.raises(RuntimeError, match="outside the registered regions"):
        _worker_regions(regions, np.array([[base + 8 * block - 8, 16, 0]], dtype=U64))
