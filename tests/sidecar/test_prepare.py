"""Prepare: a pull planned before it comes reads on that plan, and only when it is the same pull."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from kvxfer.harness.worker_sim import POISON
from kvxfer.server.app import Sidecar
from kvxfer.server.prepared import MAX_PREPARED, MAX_PREPARED_DESCRIPTORS, PreparedPull, PreparedPulls, plan_key
from kvxfer.wire import common_pb2, local_pb2
from tests.sidecar.helpers import Harness, attention, expect_error


def plans(sidecar: Sidecar, outcome: str) -> float:
    assert sidecar.metrics is not None
    value = sidecar.metrics.registry.get_sample_value("kvxfer_prepared_pulls_total", {"outcome": outcome})
    assert value is not None
    return value


async def granted(ds: Sidecar, rid: str) -> None:
    assert ds.core is not None
    for _ in range(500):  # the first hold goes out at once
        if rid in ds.core.holds.grants:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no grant for {rid!r}")


async def test_a_prepared_pull_reads_on_its_plan(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    address = ps[0].peer_address
    for rid, blocks, salt in (("planned", [1, 2, 3, 9], 7), ("unplanned", [4, 5, 6, 10], 8)):
        await pw[0].prefill(rid, {"kv": blocks}, salt=salt)
        await dw[0].client.expect(rid, [address])
        await granted(ds[0], rid)
    c = dw[0].client
    assert await c.prepare("planned", [address], {"kv": [7, 8, 9, 12]}, remote_blocks={"kv": [1, 2, 3, 9]})
    assert ds[0].core is not None
    assert len(ds[0].core.puller.prepared) == 1
    assert (plans(ds[0], "prepared"), plans(ds[0], "used")) == (1, 0)
    res = await dw[0].pull("planned", ps, {"kv": [7, 8, 9, 12]}, remote_blocks={"kv": [1, 2, 3, 9]})
    assert dw[0].verify({"kv": [7, 8, 9, 12]}, 7) == (res.bytes, 0)
    assert res.bytes == 4 * lay.page_bytes * lay.num_layers
    assert (plans(ds[0], "used"), plans(ds[0], "replanned")) == (1, 0)
    assert len(ds[0].core.puller.prepared) == 0  # taken by its pull
    # A Prepare that comes after its pull (it raced it over another connection) is not kept.
    assert not await c.prepare("planned", [address], {"kv": [7, 8, 9, 12]}, remote_blocks={"kv": [1, 2, 3, 9]})
    assert len(ds[0].core.puller.prepared) == 0
    # The same shape of pull planned at its own time: the same descriptors (runs 7-9 and 12 <- 1-3 and 9).
    plain = await dw[0].pull("unplanned", ps, {"kv": [13, 14, 15, 17]}, remote_blocks={"kv": [4, 5, 6, 10]})
    assert dw[0].verify({"kv": [13, 14, 15, 17]}, 8) == (plain.bytes, 0)
    assert (res.descriptors, res.bytes) == (plain.descriptors, plain.bytes)
    assert (plans(ds[0], "prepared"), plans(ds[0], "used"), plans(ds[0], "replanned")) == (1, 1, 0)


async def test_a_pull_that_differs_from_its_prepare_plans_anew(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    address = ps[0].peer_address
    await pw[0].prefill("moved", {"kv": [1, 2, 3]}, salt=5)
    await dw[0].client.expect("moved", [address])
    await granted(ds[0], "moved")
    assert await dw[0].client.prepare("moved", [address], {"kv": [7, 8, 9]}, remote_blocks={"kv": [1, 2, 3]})
    dw[0].poison({"kv": [9]})
    # vLLM gave the request other blocks after all: the pull names block 10, not 9.
    res = await dw[0].pull("moved", ps, {"kv": [7, 8, 10]}, remote_blocks={"kv": [1, 2, 3]})
    assert dw[0].verify({"kv": [7, 8, 10]}, 5) == (res.bytes, 0)
    buf = dw[0].buffers["kv"]
    for layer in range(lay.num_layers):  # the block only the Prepare named stays as poisoned
        for plane in lay.planes:
            assert (np.asarray(buf.rows(layer, plane)[[9]]) == POISON).all()
    assert (plans(ds[0], "prepared"), plans(ds[0], "used"), plans(ds[0], "replanned")) == (1, 0, 1)


async def test_a_prepare_that_races_its_pull_never_holds_it_up_nor_stays_behind(harness: Harness) -> None:
    # The scheduler and the worker send them at about the same time, on two connections.
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    scheduler = await harness.worker(ds[0], {"kv": lay}, register=False)
    address = ps[0].peer_address
    assert ds[0].core is not None
    for i in range(6):
        rid = f"race{i}"
        await pw[0].prefill(rid, {"kv": [1, 2, 3]}, salt=i)
        await dw[0].client.expect(rid, [address])
        await granted(ds[0], rid)
        local, remote = {"kv": [4 + i, 20, 30 + i]}, {"kv": [1, 2, 3]}
        prep = scheduler.client.prepare(rid, [address], local, remote_blocks=remote)
        planned, res = await asyncio.gather(prep, dw[0].pull(rid, ps, local, remote_blocks=remote))
        assert dw[0].verify(local, i) == (res.bytes, 0)
        assert len(ds[0].core.puller.prepared) == 0  # used by its pull, or not kept once the pull had started
        # Every plan kept was read on; a Prepare that came second planned nothing.
        assert (plans(ds[0], "used"), plans(ds[0], "replanned")) == (plans(ds[0], "prepared"), 0)
        assert isinstance(planned, bool)


async def test_a_plan_is_dropped_by_an_abort_and_by_a_new_registration(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    address = ps[0].peer_address
    await pw[0].prefill("a", {"kv": [1]}, salt=1)
    assert ds[0].core is not None
    prepared = ds[0].core.puller.prepared
    assert await dw[0].client.prepare("a", [address], {"kv": [2]}, remote_blocks={"kv": [1]})
    assert "a" in prepared
    await dw[0].client.abort("a", "the request finished")
    assert "a" not in prepared
    # Without the publisher's block ids there is nothing to plan ahead: the Pull looks them up.
    assert not await dw[0].client.prepare("a", [address], {"kv": [2]})
    assert len(prepared) == 0
    # A plan is made against this worker's registration: registering again drops it.
    assert await dw[0].client.prepare("a", [address], {"kv": [2]}, remote_blocks={"kv": [1]})
    await dw[0].register()
    assert len(prepared) == 0
    res = await dw[0].pull("a", ps, {"kv": [2]}, remote_blocks={"kv": [1]})
    assert dw[0].verify({"kv": [2]}, 1) == (res.bytes, 0)
    assert (plans(ds[0], "prepared"), plans(ds[0], "used")) == (2, 0)


async def test_prepare_is_checked_like_a_pull(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    address = ps[0].peer_address
    c = dw[0].client
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.prepare("r", [], {"kv": [1]}),
                       "pull.remote_addresses: give the peer API")  # fmt: skip
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.prepare("", [address], {"kv": [1]}), "pull.request_id")
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                       c.prepare("r", [address], {"kv": [lay.num_blocks]}, remote_blocks={"kv": [1]}),
                       f"pull.local_blocks[kv]: block id {lay.num_blocks} at position 0 is out of range")  # fmt: skip
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT,
                       c.prepare("r", [address], {"kv": [1, 2]}, remote_blocks={"kv": [1, 1]}),
                       "remote_blocks[kv]")  # fmt: skip
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION,
                       pw[0].client.prepare("r", [address], {"kv": [1]}, remote_blocks={"kv": [1]}),
                       "--role prefill")  # fmt: skip


def test_the_key_compares_every_field_but_the_calls_own() -> None:
    def req(**kw: object) -> local_pb2.PullRequest:
        base: dict[str, object] = {
            "request_id": "r", "remote_addresses": ["10.0.0.1:5000"],
            "local_blocks": [common_pb2.BlockList(group="kv", block_ids=[1, 2])],
            "remote_blocks": [common_pb2.BlockList(group="kv", block_ids=[3, 4])],
        }  # fmt: skip
        return local_pb2.PullRequest(**(base | kw))  # type: ignore[arg-type]

    key = plan_key(req())
    called = req(wait=True, timeout_seconds=3.0, worker_gather=True)
    assert plan_key(called) == key
    assert (called.wait, called.timeout_seconds, called.worker_gather) == (True, 3.0, True)  # put back
    for other in (
        req(local_blocks=[common_pb2.BlockList(group="kv", block_ids=[1, 5])]),
        req(remote_blocks=[common_pb2.BlockList(group="kv", block_ids=[3, 4], skip_tokens=1)]),
        req(remote_addresses=["10.0.0.2:5000"]),
        req(remote_engine_id="other"),
        req(push=True),
        req(request_id="s"),
    ):
        assert plan_key(other) != key


def test_plans_are_kept_up_to_a_cap_oldest_first() -> None:
    kept = PreparedPulls()

    def plan(until: float) -> PreparedPull:
        return PreparedPull(b"k", 1, {}, {}, {}, {}, (), until)

    kept.put("old", plan(until=0.0))  # expired: dropped by the next put
    for i in range(MAX_PREPARED + 1):
        kept.put(f"r{i}", plan(until=float("inf")))
    assert len(kept) == MAX_PREPARED
    assert "old" not in kept
    assert "r0" not in kept
    assert f"r{MAX_PREPARED}" in kept
    assert kept.take("r1", b"other") is None  # made for another pull: dropped, not handed out
    assert "r1" not in kept
    assert kept.take("r2", b"k") is not None
    # Descriptors are capped too: two plans of just over half the cap cannot both stay.
    half = MAX_PREPARED_DESCRIPTORS // 2 + 1
    rows = np.zeros((half, 3), dtype=np.uint64)
    big = PreparedPull(b"k", 1, {}, {}, {}, {0: [(rows, rows)]}, (), float("inf"))
    kept.clear()
    kept.put("big1", big)
    kept.put("big2", big)
    assert ("big1" in kept, "big2" in kept, kept.descriptors) == (False, True, half)


async def test_a_pull_refused_for_its_input_leaves_the_plan_to_the_real_pull(harness: Harness) -> None:
    """The plan was taken before the Pull's own checks (its timeout), so a Pull refused for a bad
    ``timeout_seconds`` threw the request's plan away and the corrected Pull planned anew; the refusal
    now leaves the plan, and the Pull that follows reads on it."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    address = ps[0].peer_address
    await pw[0].prefill("r", {"kv": [1, 2]}, salt=3)
    await dw[0].client.expect("r", [address])
    await granted(ds[0], "r")
    c = dw[0].client
    assert await c.prepare("r", [address], {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]})
    assert ds[0].core is not None
    for bad in (-1.0, float("nan")):
        req = local_pb2.PullRequest(request_id="r", remote_addresses=[address], wait=True, timeout_seconds=bad,
                                    local_blocks=[common_pb2.BlockList(group="kv", block_ids=[5, 6])],
                                    remote_blocks=[common_pb2.BlockList(group="kv", block_ids=[1, 2])])  # fmt: skip
        err = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c._call(c._stub.Pull, req, 10.0),
                                 "timeout_seconds", str(bad))  # fmt: skip
        assert err.field == "timeout_seconds"
        assert "r" in ds[0].core.puller.prepared
    res = await dw[0].pull("r", ps, {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]})
    assert dw[0].verify({"kv": [5, 6]}, 3) == (res.bytes, 0)
    assert (plans(ds[0], "prepared"), plans(ds[0], "used"), plans(ds[0], "replanned")) == (1, 1, 0)
