"""Reading ahead of the lookup: a pull that names the publisher's block ids READs while GetPublished runs.

The READ uses the region tables of the publisher's handshake; the pull succeeds only once the
lookup confirmed the publish (and the publisher's registration), so a failed confirmation fails
the pull and a publisher that registered other memory since is read again with what it answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvxfer.errors import Reason
from kvxfer.server.app import Sidecar
from tests.sidecar.helpers import DelayedDataPlane, Harness, Worker, attention, expect_error

HOLD_S = 0.4  # the data plane's hold before each READ, and the publisher's before each lookup answer


async def test_the_lookup_overlaps_the_read(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    lay = attention()
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    pw = await harness.worker(p, {"kv": lay})
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=DelayedDataPlane("decode-slow", HOLD_S))
    dw = await harness.worker(d, {"kv": lay})
    await pw.prefill("warm", {"kv": [1]}, salt=1)
    await dw.pull("warm", [p], {"kv": [2]})  # handshake (cached from now on)
    assert p.core is not None
    answer = p.core.peer_get_published

    async def slow_answer(req: Any, *args: Any) -> Any:  # FAULT INJECTOR: a slow control plane
        await asyncio.sleep(HOLD_S)
        return await answer(req, *args)

    monkeypatch.setattr(p.core, "peer_get_published", slow_answer)
    await pw.prefill("r1", {"kv": [3, 4]}, salt=2)
    ahead = await dw.pull("r1", [p], {"kv": [5, 6]}, remote_blocks={"kv": [3, 4]})
    assert dw.verify({"kv": [5, 6]}, 2) == (ahead.bytes, 0)
    assert ahead.fetch_seconds >= HOLD_S
    assert ahead.data_seconds >= HOLD_S
    assert ahead.duration_seconds < 2 * HOLD_S  # side by side, not one after the other
    # Without the publisher's ids the reader must wait for the lookup first.
    await pw.prefill("r2", {"kv": [7, 8]}, salt=3)
    after = await dw.pull("r2", [p], {"kv": [9, 10]})
    assert dw.verify({"kv": [9, 10]}, 3) == (after.bytes, 0)
    assert after.duration_seconds >= 2 * HOLD_S


async def test_a_read_ahead_whose_lookup_fails_fails_and_harms_no_other_publish(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("kept", {"kv": [1, 2]}, salt=4)
    await expect_error(grpc.StatusCode.NOT_FOUND, dw[0].pull("never", ps, {"kv": [3]}, remote_blocks={"kv": [1]}),
                       "'never' is not published")  # fmt: skip
    # ids that exist in the publisher's memory but were not published for this request: refused,
    # and the publish stays as it was for the corrected retry
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].pull("kept", ps, {"kv": [3]}, remote_blocks={"kv": [9]}),
                       "remote_blocks[kv]: block id 9")  # fmt: skip
    assert (await pw[0].client.status())["leases"] == 1
    res = await dw[0].pull("kept", ps, {"kv": [4, 5]}, remote_blocks={"kv": [1, 2]})
    assert dw[0].verify({"kv": [4, 5]}, 4) == (res.bytes, 0)


async def test_a_publisher_that_registered_other_memory_is_read_again(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("before", {"kv": [1]}, salt=5)
    await dw[0].pull("before", ps, {"kv": [2]}, remote_blocks={"kv": [1]})  # the reader caches the handshake
    # The reader's notice frees the publish a little after the pull's answer (notices wait ~5 ms for
    # company); a registration is not replaced under a published request.
    for _ in range(500):
        if (await pw[0].client.status())["leases"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await pw[0].client.status())["leases"] == 0
    # The prefill worker restarts with new memory (other addresses, new epoch); the reader's cached
    # regions are now stale: it reads ahead from them, the lookup says so, and it reads again.
    fresh = Worker(ps[0], {"kv": lay}, pw[0].rank)
    harness.workers.append(fresh)
    await pw[0].client.close()
    await fresh.register()
    await fresh.prefill("after", {"kv": [3, 4]}, salt=6)
    res = await dw[0].pull("after", ps, {"kv": [5, 6]}, remote_blocks={"kv": [3, 4]})
    assert dw[0].verify({"kv": [5, 6]}, 6) == (res.bytes, 0)


async def test_a_read_again_is_not_reported_moved_while_the_first_read_may_still_land(harness: Harness) -> None:
    """As above, but the stale READ failed unfenced (still in flight after the fence budget): the READ again
    succeeds, yet the pull fails with reason DATA_PLANE_UNFENCED, since the first READ may still land in the
    blocks once the worker uses them (it used to be reported moved). GetStatus names it unsettled until the
    data plane sees that READ end."""
    p, dw, dp = await _publisher_registered_again(harness, "decode-stale")
    # FAULT INJECTOR: the stale READ fails unfenced, after the lookup answered (which a failed READ would cut)
    dp.fail_first, dp.unfenced_first = 0.3, True
    exc = await expect_error(grpc.StatusCode.UNAVAILABLE,
                             dw.pull("after", [p], {"kv": [5, 6]}, remote_blocks={"kv": [3, 4]}),
                             "1 earlier READ(s) of it, which failed, were still in flight")  # fmt: skip
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    assert dw.verify({"kv": [5, 6]}, 6)[1] == 0  # the READ again did move the bytes
    assert (await dw.client.status(unsettled=["after"]))["unsettled"] == ["after"]
    dp.unfenced_ops[0].ended = True
    assert (await dw.client.status(unsettled=["after"]))["unsettled"] == []


async def test_a_read_again_that_fails_still_says_the_first_read_may_land(harness: Harness) -> None:
    """As above, but the READ again does not finish either (the pull's deadline cuts it, fenced): the pull's
    error must still carry reason DATA_PLANE_UNFENCED and GetStatus name it unsettled, since the first READ may
    still land in the blocks (the failure used to be a plain DEADLINE, and the worker reused them at once)."""
    p, dw, dp = await _publisher_registered_again(harness, "decode-stale-again")
    # FAULT INJECTOR: the stale READ fails unfenced after the lookup answered; the READ again is held past the deadline
    dp.fail_first, dp.unfenced_first, dp.delay = 0.3, True, 30.0
    exc = await expect_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                             dw.pull("after", [p], {"kv": [5, 6]}, remote_blocks={"kv": [3, 4]}, deadline=1.5),
                             "may still land")  # fmt: skip
    assert exc.reason == Reason.DATA_PLANE_UNFENCED
    assert (await dw.client.status(unsettled=["after"]))["unsettled"] == ["after"]
    dp.unfenced_ops[0].ended = True
    assert (await dw.client.status(unsettled=["after"]))["unsettled"] == []


async def _publisher_registered_again(harness: Harness, name: str) -> tuple[Sidecar, Worker, DelayedDataPlane]:
    """A reader (its data plane ``name``, a FAULT INJECTOR the test arms) that cached a publisher's regions,
    and the publisher's worker registered again with new memory since, publishing "after" (salt 6) in blocks
    3 and 4: (the publisher, the reader's worker, its data plane)."""
    lay = attention()
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    pw = await harness.worker(p, {"kv": lay})
    dp = DelayedDataPlane(name, 0.0)
    d = await harness.sidecar(role="decode", engine_id="decode", data_plane=dp)
    dw = await harness.worker(d, {"kv": lay})
    await pw.prefill("before", {"kv": [1]}, salt=5)
    await dw.pull("before", [p], {"kv": [2]}, remote_blocks={"kv": [1]})
    for _ in range(500):
        if (await pw.client.status())["leases"] == 0:
            break
        await asyncio.sleep(0.01)
    fresh = Worker(p, {"kv": lay}, pw.rank)
    harness.workers.append(fresh)
    await pw.client.close()
    await fresh.register()
    await fresh.prefill("after", {"kv": [3, 4]}, salt=6)
    return p, dw, dp
