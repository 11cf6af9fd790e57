"""Leases that follow the reader: a decode side that waits longer than the lease still pulls exactly."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from kvxfer.client import PullItem
from kvxfer.errors import FailedPreconditionError
from kvxfer.metrics import PULL_PATHS
from kvxfer.server import holds as holds_module
from kvxfer.server.app import Sidecar
from kvxfer.wire import common_pb2, local_pb2
from tests.sidecar.helpers import Harness, Worker, attention, expect_error, peer_lookups

LEASE = 1.0  # seconds; holds go out every LEASE / 3


async def test_an_expected_request_outlives_its_lease_until_pulled(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=LEASE, max_hold_seconds=3.0)
    await pw[0].prefill("held", {"kv": [1, 2]}, salt=1)
    await pw[0].prefill("unheld", {"kv": [3, 4]}, salt=2)
    await pw[0].prefill("too-long", {"kv": [5, 6]}, salt=3)
    assert await dw[0].client.expect("held", [ps[0].peer_address])
    assert not await dw[0].client.expect("held", [ps[0].peer_address])  # already expected
    assert await dw[0].client.expect("too-long", [ps[0].peer_address])
    await asyncio.sleep(2.5 * LEASE)  # the decode engine keeps them queued for 2.5 leases
    # The held request is still published; the one nobody expected expired after one lease.
    res = await dw[0].pull("held", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 1) == (res.bytes, 0)
    await expect_error(
        grpc.StatusCode.NOT_FOUND, dw[0].pull("unheld", ps, {"kv": [9, 10]}), "'unheld' is not published"
    )
    # Holds never keep a publish past --max-hold-seconds (3 s here) after it was published.
    await asyncio.sleep(3.0 + LEASE - 2.5 * LEASE + 0.5)
    await expect_error(
        grpc.StatusCode.NOT_FOUND, dw[0].pull("too-long", ps, {"kv": [11]}), "'too-long' is not published"
    )
    assert ds[0].core is not None
    assert ds[0].core.holds.expected == {}  # the pull ended the first hold; the publisher's answer the other


async def test_a_publish_with_a_lease_shorter_than_the_hold_period_is_still_held(harness: Harness) -> None:
    """The reader's rounds follow the publisher's lease, not its own: a publish leased for 1 s
    (``Publish.lease_seconds``, the vLLM connector's ``lease_seconds``) read by a decode side whose
    own ``--lease-seconds`` (30 s) spaces its rounds 5 s apart is held again within a third of that
    second, every third of it, until its pull."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    holds = _hold_sizes(ps[0])
    await pw[0].prefill("short", {"kv": [1, 2]}, salt=5, lease=1.0)
    await pw[0].prefill("unheld", {"kv": [3]}, salt=6, lease=1.0)
    assert await dw[0].client.expect("short", [ps[0].peer_address])
    await asyncio.sleep(2.6)  # the decode engine keeps it queued for 2.6 of its leases
    res = await dw[0].pull("short", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 5) == (res.bytes, 0)
    assert 5 <= len(holds) <= 12  # the first Hold, then one every third of the 1 s lease
    await expect_error(grpc.StatusCode.NOT_FOUND, dw[0].pull("unheld", ps, {"kv": [9]}), "'unheld' is not published")
    await asyncio.sleep(0.5)
    assert len(holds) <= 12  # the pull ended the holding


async def test_status_tells_the_publisher_how_long_holds_kept_its_publishes(harness: Harness) -> None:
    """The prefill worker hears of no extension; ``GetStatus(publishes)`` is how it learns whether a
    publish whose lease (as Publish answered) ran out is still held, and until when."""
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    first_end = await pw[0].prefill("queued", {"kv": [1]}, salt=1, lease=1.0)
    await pw[0].prefill("alone", {"kv": [2]}, salt=2, lease=1.0)
    assert await dw[0].client.expect("queued", [ps[0].peer_address])
    await asyncio.sleep(1.5)
    status = await pw[0].client.status(publishes=["queued", "alone", "never-published"])
    assert list(status["publishes"]) == ["queued"]  # "alone" expired; the other was never there
    assert status["publishes"]["queued"] > first_end + 400  # extended by the Holds since
    c = pw[0].client
    too_many = c.status(publishes=[f"r{i}" for i in range(1025)])
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, too_many, "publishes: 1025 request ids; at most 1024")


async def test_a_grant_is_dropped_when_its_publisher_aborts_the_publish(harness: Harness) -> None:
    """A publisher that drops a held publish (its worker's Abort) tells the reader it granted; the
    reader's pull then asks, and fails, instead of reading blocks the prefill side freed on its grant."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    await pw[0].prefill("dropped", {"kv": [1, 2]}, salt=3)
    await dw[0].client.expect("dropped", [ps[0].peer_address])
    grants = ds[0].core.holds.grants
    for _ in range(200):
        if "dropped" in grants:
            break
        await asyncio.sleep(0.01)
    assert "dropped" in grants
    assert (await pw[0].client.abort("dropped")) == (0, True)
    for _ in range(200):  # the publisher tells its readers as it drops the publish
        if "dropped" not in grants:
            break
        await asyncio.sleep(0.01)
    assert "dropped" not in grants
    pull = dw[0].pull("dropped", ps, {"kv": [7, 8]}, remote_blocks={"kv": [1, 2]})
    await expect_error(grpc.StatusCode.NOT_FOUND, pull, "'dropped' is not published")


async def test_an_aborted_publish_stays_the_workers_until_its_granted_reader_is_told(harness: Harness) -> None:
    """The reader that holds a grant cannot be told (its sidecar is gone): the publisher's worker hears
    ABORTED (and frees the blocks) only once the lease the grant promised has run out."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    await pw[0].prefill("r", {"kv": [1]}, salt=1, lease=1.0)
    await dw[0].client.expect("r", [ps[0].peer_address])
    for _ in range(200):
        if "r" in ds[0].core.holds.grants:
            break
        await asyncio.sleep(0.01)
    assert "r" in ds[0].core.holds.grants
    await ds[0].stop(0)  # the reader holds a grant and cannot be told any more
    until_ms = (await pw[0].client.status(publishes=["r"]))["publishes"]["r"]
    aborted = asyncio.ensure_future(_first_event(pw[0], "ABORTED"))
    await asyncio.sleep(0.05)
    assert await pw[0].client.abort("r", "preempted") == (0, True)
    # Dropped, but its blocks are not the worker's yet: a worker that asks hears it is still held.
    assert (await pw[0].client.status(publishes=["r"]))["publishes"] == {"r": until_ms}
    ev = await asyncio.wait_for(aborted, 10)
    assert (ev.request_id, ev.message) == ("r", "preempted")
    assert time.time() * 1000 >= until_ms - 20  # not before the grant could run out
    assert (await pw[0].client.status(publishes=["r"]))["publishes"] == {}


async def test_a_publisher_that_never_answers_delays_no_other_publishers_holds(harness: Harness) -> None:
    """One publisher's host is gone (its address takes connections and never answers: each Hold there
    waits out the 10 s peer-call budget). A request expected at another publisher, before it and
    after it, is still held there at its lease's pace and read."""
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    silent = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    gone = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        await pw[0].prefill("before", {"kv": [1, 2]}, salt=4, lease=1.0)
        await pw[0].prefill("after", {"kv": [3, 4]}, salt=5, lease=1.0)
        assert await dw[0].client.expect("before", [ps[0].peer_address])
        await asyncio.sleep(0.1)
        assert await dw[0].client.expect("stuck", [gone])
        await asyncio.sleep(0.1)  # the silent publisher's first Hold is out, and stays out
        assert await dw[0].client.expect("after", [ps[0].peer_address])
        await asyncio.sleep(2.5)  # 2.5 of their leases
        for rid, blocks, salt in (("before", [7, 8], 4), ("after", [9, 10], 5)):
            res = await dw[0].pull(rid, ps, {"kv": blocks})
            assert dw[0].verify({"kv": blocks}, salt) == (res.bytes, 0)
    finally:
        silent.close()


async def test_expect_is_checked_like_a_pull(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    c = dw[0].client
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.expect("r", []), "remote_addresses: give the peer API")
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.expect("", [ps[0].peer_address]), "request_id")
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, pw[0].client.expect("r", [ps[0].peer_address]),
                       "--role prefill")  # fmt: skip


async def test_a_held_request_is_read_on_its_grant_without_a_lookup(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    await pw[0].prefill("granted", {"kv": [1, 2, 3]}, salt=7)
    await pw[0].prefill("wrong-ids", {"kv": [4]}, salt=8)
    assert ps[0].core is not None
    assert ds[0].core is not None
    lookups: list[str] = []
    answer, answer_batch = ps[0].core.peer_get_published, ps[0].core.peer_get_published_batch

    async def counted(req: Any, *args: Any) -> Any:  # counts lookups; answers as before
        lookups.append(req.request_id)
        return await answer(req, *args)

    async def counted_batch(req: Any, *args: Any) -> Any:
        lookups.extend(r.request_id for r in req.requests)
        return await answer_batch(req, *args)

    ps[0].core.peer_get_published = counted  # type: ignore[method-assign]
    ps[0].core.peer_get_published_batch = counted_batch  # type: ignore[method-assign]
    for rid in ("granted", "wrong-ids"):
        await dw[0].client.expect(rid, [ps[0].peer_address])
    for _ in range(500):  # the first hold goes out at once
        if {"granted", "wrong-ids"} <= ds[0].core.holds.grants.keys():
            break
        await asyncio.sleep(0.01)
    res = await dw[0].pull("granted", ps, {"kv": [7, 8, 9]}, remote_blocks={"kv": [1, 2, 3]})
    assert dw[0].verify({"kv": [7, 8, 9]}, 7) == (res.bytes, 0)
    assert res.fetch_seconds == 0.0
    assert lookups == []  # no control round trip before the READ
    # The grant made the reader one that may free it: its DONE notice releases the publish.
    for _ in range(500):
        if (await pw[0].client.status())["leases"] == 1:
            break
        await asyncio.sleep(0.01)
    assert (await pw[0].client.status())["leases"] == 1
    # Ids the grant does not cover: no READ on the grant; the lookup refuses them.
    wrong = dw[0].pull("wrong-ids", ps, {"kv": [10]}, remote_blocks={"kv": [5]})
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, wrong, "remote_blocks[kv]")
    assert lookups == ["wrong-ids"]


async def test_a_request_expected_between_rounds_is_held_at_once(harness: Harness) -> None:
    # lease 30 s: rounds every 5 s. A request expected while the holding task sleeps gets its
    # grant now, not at the next round: the pull that follows within milliseconds reads on it.
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    grants = ds[0].core.holds.grants
    for rid, block in (("first", 1), ("second", 2)):
        await pw[0].prefill(rid, {"kv": [block]}, salt=block)
        await dw[0].client.expect(rid, [ps[0].peer_address])
        for _ in range(100):
            if rid in grants:
                break
            await asyncio.sleep(0.01)
        assert rid in grants, f"no grant for {rid!r} within 1 s"
        assert grants[rid][ps[0].peer_address].blocks["kv"].tolist() == [block]


async def test_requests_expected_together_share_their_first_holds(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    holds = _hold_sizes(ps[0])
    rids = [f"r{i}" for i in range(12)]
    for i, rid in enumerate(rids):
        await pw[0].prefill(rid, {"kv": [i]}, salt=i)
    await dw[0].client.expect("first", [ps[0].peer_address])  # starts the rounds: the first round holds it
    for _ in range(200):
        if holds:
            break
        await asyncio.sleep(0.01)
    for rid in rids:  # twelve requests arrive at once (between two rounds)
        ds[0].core.holds.expect(rid, [ps[0].peer_address])
    grants = ds[0].core.holds.grants
    for _ in range(200):
        if set(rids) <= grants.keys():
            break
        await asyncio.sleep(0.01)
    assert set(rids) <= grants.keys()
    assert holds == [1, 12]  # one Hold for the twelve, not one each


async def test_fresh_holds_leave_at_most_one_per_spacing(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request expected now and then is held at once; those expected soon after go together."""
    monkeypatch.setattr(holds_module, "FRESH_HOLD_SPACING_S", 0.3)  # wide, so that no host is too slow for it
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    assert ds[0].core is not None
    sizes = _hold_sizes(ps[0])
    for i, rid in enumerate(("first", "a", "b", "c")):
        await pw[0].prefill(rid, {"kv": [i]}, salt=i)
    holds, grants = ds[0].core.holds, ds[0].core.holds.grants

    async def granted(*rids: str) -> float:
        t0 = time.monotonic()
        for _ in range(300):
            if set(rids) <= grants.keys():
                return time.monotonic() - t0
            await asyncio.sleep(0.005)
        raise AssertionError(f"no grants for {rids} within 1.5 s")

    await dw[0].client.expect("first", [ps[0].peer_address])  # the first Hold: at once
    assert await granted("first") < 0.25
    await asyncio.sleep(0.3)  # past its spacing
    await dw[0].client.expect("a", [ps[0].peer_address])  # at once again
    assert await granted("a") < 0.25
    for rid in ("b", "c"):  # within the spacing of a's Hold: they wait for it, and go together
        await dw[0].client.expect(rid, [ps[0].peer_address])
    await granted("b", "c")
    assert sizes == [1, 1, 2]
    assert holds.fresh_holds == 3


def _hold_sizes(prefill: Sidecar) -> list[int]:
    """How many request ids each peer Hold that reaches ``prefill`` carries, in order (filled as they come)."""
    assert prefill.core is not None
    sizes: list[int] = []
    answer = prefill.core.peer_hold

    async def counted(req: Any, *args: Any) -> Any:
        sizes.append(len(req.request_ids))
        return await answer(req, *args)

    prefill.core.peer_hold = counted  # type: ignore[method-assign]
    return sizes


def _gate_holds(prefill: Sidecar, fail: bool = False) -> asyncio.Event:
    """A named fault: ``prefill`` answers peer Holds only once the returned event is set (``fail``: then
    refuses them, as a publisher that lost its state would), so that a pull comes while its Hold is out."""
    assert prefill.core is not None
    gate = asyncio.Event()
    answer = prefill.core.peer_hold

    async def gated(req: Any, *args: Any) -> Any:
        await gate.wait()
        if fail:
            raise FailedPreconditionError("held back by the test", field="request_ids")
        return await answer(req, *args)

    prefill.core.peer_hold = gated  # type: ignore[method-assign]
    return gate


def _paths(decode: Sidecar) -> dict[str, float]:
    assert decode.metrics is not None
    get = decode.metrics.registry.get_sample_value
    return {p: get("kvxfer_pulls_by_path_total", {"path": p}) or 0.0 for p in PULL_PATHS}


async def test_a_pull_that_comes_while_its_hold_is_out_reads_on_the_holds_answer(harness: Harness) -> None:
    """vLLM pulls in the engine step that expected the request: the Pull overtakes the first Hold's answer."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    await pw[0].prefill("soon", {"kv": [1, 2]}, salt=3)
    lookups, gate = peer_lookups(ps[0]), _gate_holds(ps[0])
    await dw[0].client.expect("soon", [ps[0].peer_address])
    pull = asyncio.ensure_future(dw[0].pull("soon", ps, {"kv": [5, 6]}, remote_blocks={"kv": [1, 2]}))
    assert ds[0].core is not None
    for _ in range(400):  # the READs ran ahead of the Hold's answer
        nbytes, wrong = dw[0].verify({"kv": [5, 6]}, 3)
        if wrong == 0:
            break
        await asyncio.sleep(0.005)
    assert wrong == 0
    await asyncio.sleep(0.05)
    assert not pull.done()  # but the pull is confirmed only by the answer
    gate.set()
    res = await pull
    assert res.bytes == nbytes
    assert res.fetch_seconds > 0.05  # the wait for the answer
    assert lookups == []  # the Hold's answer was the only round trip
    assert _paths(ds[0]) == {"grant": 0, "hold_answer": 1, "ahead": 0, "lookup": 0, "push": 0}
    assert ds[0].core.holds._first == {}  # nothing left waiting


async def test_a_pull_whose_hold_is_refused_looks_the_request_up(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    await pw[0].prefill("refused", {"kv": [4]}, salt=9)
    lookups, gate = peer_lookups(ps[0]), _gate_holds(ps[0], fail=True)
    await dw[0].client.expect("refused", [ps[0].peer_address])
    pull = asyncio.ensure_future(dw[0].pull("refused", ps, {"kv": [8]}, remote_blocks={"kv": [4]}))
    await asyncio.sleep(0.1)
    assert not pull.done()  # waiting for the Hold's answer
    gate.set()
    res = await pull
    assert dw[0].verify({"kv": [8]}, 9) == (res.bytes, 0)
    assert lookups == ["refused"]  # no grant came: the lookup confirmed the READ
    assert _paths(ds[0]) == {"grant": 0, "hold_answer": 0, "ahead": 1, "lookup": 0, "push": 0}


async def test_a_pull_sends_its_spaced_hold_at_once(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds_module, "FRESH_HOLD_SPACING_S", 30.0)  # a request expected after another waits
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    for rid, block in (("first", 1), ("second", 2)):
        await pw[0].prefill(rid, {"kv": [block]}, salt=block)
    sizes, lookups = _hold_sizes(ps[0]), peer_lookups(ps[0])
    await dw[0].client.expect("first", [ps[0].peer_address])  # its Hold leaves at once
    await dw[0].client.expect("second", [ps[0].peer_address])  # its Hold would wait 30 s
    t0 = time.monotonic()
    res = await dw[0].pull("second", ps, {"kv": [9]}, remote_blocks={"kv": [2]}, deadline=10.0)
    assert time.monotonic() - t0 < 5.0
    assert dw[0].verify({"kv": [9]}, 2) == (res.bytes, 0)
    assert sizes == [1, 1]
    assert lookups == []
    assert _paths(ds[0])["hold_answer"] == 1


async def test_an_aborted_pull_leaves_its_holds_late_answer_to_nobody(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=30)
    await pw[0].prefill("gone", {"kv": [3]}, salt=4)
    gate = _gate_holds(ps[0])
    await dw[0].client.expect("gone", [ps[0].peer_address])
    pull = asyncio.ensure_future(dw[0].pull("gone", ps, {"kv": [7]}, remote_blocks={"kv": [3]}))
    await asyncio.sleep(0.1)
    await dw[0].client.abort("gone")
    await expect_error(grpc.StatusCode.ABORTED, pull, "gone")
    assert ds[0].core is not None
    assert ds[0].core.holds._first == {}  # the abort settled what was due: nobody waits for it
    gate.set()  # the Hold's late answer finds nobody
    await asyncio.sleep(0.1)
    assert ds[0].core.holds.grants == {}
    # The decode side serves the next pull of the request as any other: a lookup, then the READ.
    res = await dw[0].pull("gone", ps, {"kv": [7]})
    assert dw[0].verify({"kv": [7]}, 4) == (res.bytes, 0)


async def _first_event(worker: Worker, kind: str) -> Any:
    async for ev in worker.client.watch_completions():
        if ev.kind == kind:
            return ev
    raise AssertionError("stream ended")


async def test_a_refused_pull_leaves_its_request_held(harness: Harness) -> None:
    """A Pull refused for its own input (a bad field, or a batch refused whole) starts nothing, so it
    must not end the request's holds: the corrected Pull that follows still finds the publish."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=LEASE, max_hold_seconds=10.0)
    assert ds[0].core is not None
    await pw[0].prefill("held", {"kv": [1, 2]}, salt=1)
    assert await dw[0].client.expect("held", [ps[0].peer_address])
    bad_timeout = local_pb2.PullRequest(request_id="held", remote_addresses=[ps[0].peer_address], wait=True,
                                        timeout_seconds=-1.0,
                                        local_blocks=[common_pb2.BlockList(group="kv", block_ids=[7, 8])])  # fmt: skip
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client._call(dw[0].client._stub.Pull, bad_timeout, 10.0),
                       "timeout_seconds")  # fmt: skip
    address = ps[0].peer_address
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.pull("held", [address], {"kv": [lay.num_blocks]}),
                       "local_blocks[kv]")  # fmt: skip
    too_many = [PullItem("held", [address], {"kv": [7, 8]})] * 1025
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.pull_batch(too_many), "1025 pulls")
    assert "held" in ds[0].core.holds.expected
    await asyncio.sleep(2.5 * LEASE)  # queued for 2.5 leases after its refused pulls
    res = await dw[0].pull("held", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 1) == (res.bytes, 0)


async def test_a_refused_abort_leaves_its_request_held(harness: Harness) -> None:
    """An Abort refused for a malformed remote address stops nothing: the request stays expected (held)."""
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=LEASE, max_hold_seconds=10.0)
    assert ds[0].core is not None
    await pw[0].prefill("held", {"kv": [1, 2]}, salt=1)
    assert await dw[0].client.expect("held", [ps[0].peer_address])
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.drop_remote("held", ["127.0.0.1:0"]),
                       "remote_addresses[0]")  # fmt: skip
    assert "held" in ds[0].core.holds.expected
    await asyncio.sleep(2.5 * LEASE)
    res = await dw[0].pull("held", ps, {"kv": [7, 8]})
    assert dw[0].verify({"kv": [7, 8]}, 1) == (res.bytes, 0)
