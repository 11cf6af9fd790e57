"""Batched calls: PullBatch (worker -> sidecar) and GetPublishedBatch (sidecar -> sidecar).

Every pull of a batch runs and fails on its own: exact codes and messages per item, exact bytes for
the others. Lookups a reader owes one publisher go as one GetPublishedBatch when they queue up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer.client import KvxferRpcError, PullItem, PullResult, TokenSpan
from kvxfer.errors import KvxferError, Reason
from kvxfer.server.app import Sidecar
from kvxfer.wire import common_pb2, peer_pb2, peer_pb2_grpc
from tests.sidecar.helpers import Harness, Worker, attention, expect_error, transfer

LAY = attention()
OK = grpc.StatusCode


class CallCounter:
    """A spy on a core method: counts the calls and their batch sizes, then runs the real method."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sidecar: Sidecar, name: str) -> None:
        assert sidecar.core is not None
        self.sizes: list[int] = []
        real = getattr(sidecar.core, name)

        async def spy(req: Any, *args: Any) -> Any:
            self.sizes.append(len(req.requests) if hasattr(req, "requests") else 1)
            return await real(req, *args)

        monkeypatch.setattr(sidecar.core, name, spy)


async def _pair(harness: Harness) -> tuple[Sidecar, Worker, Sidecar, Worker]:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    # Handshake now, so that what the tests count is the lookups alone.
    await transfer(pw, ps, dw, "warm", {"kv": [60]}, {"kv": [60]}, salt=3)
    # And wait for its DONE notice, which leaves after the answer (and lingers to go with others),
    # so that the leases the tests count are their own: on a busy machine it may still be on its way.
    for _ in range(500):
        if (await pw[0].client.status())["leases"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await pw[0].client.status())["leases"] == 0, "the warm-up pull's publish was never released"
    return ps[0], pw[0], ds[0], dw[0]


def _item(rid: str, p: Sidecar, local: list[int], **kw: Any) -> PullItem:
    return PullItem(rid, [p.peer_address], {"kv": local}, **kw)


def _assert_failed(res: PullResult | KvxferRpcError, code: grpc.StatusCode, *fragments: str) -> None:
    assert isinstance(res, KvxferRpcError), f"expected {code.name}, got a result: {res}"
    assert res.code == code, f"expected {code.name}, got {res.code.name}: {res.details}"
    for f in fragments:
        assert f in res.details, f"{f!r} not in {res.details!r}"


async def test_pull_batch_answers_each_pull_on_its_own(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    p, pw, _d, dw = await _pair(harness)
    sources = {"a": [1, 2, 3], "b": [10, 11], "c": [20, 21], "e": [30]}
    for i, (rid, blocks) in enumerate(sources.items()):
        await pw.prefill(rid, {"kv": blocks}, salt=40 + i)
    lookups = CallCounter(monkeypatch, p, "peer_get_published_batch")
    singles = CallCounter(monkeypatch, p, "peer_get_published")
    dw.poison({"kv": list(range(0, 12))})
    results = await dw.client.pull_batch(
        [
            _item("a", p, [0, 1, 2]),
            _item("a", p, [8, 9]),  # the same request id twice in one batch
            _item("nope", p, [3]),  # never published
            _item("c", p, [4, 5], remote_blocks={"kv": [21, 22]}),  # 22 is not part of "c"
            _item("b", p, [6, 7]),
            _item("e", p, [70]),  # no such local block
            _item("bad\nid", p, [12]),
        ]
    )
    assert len(results) == 7
    a, dup, nope, c, b, e, bad = results
    _assert_failed(dup, OK.ALREADY_EXISTS, "request_id", "'a' is already in flight")
    _assert_failed(nope, OK.NOT_FOUND, "'nope' is not published", p.peer_address)
    _assert_failed(c, OK.INVALID_ARGUMENT, "remote_blocks[kv]: block id 22 at position 1 was not published")
    _assert_failed(e, OK.INVALID_ARGUMENT, "local_blocks", "70")
    _assert_failed(bad, OK.INVALID_ARGUMENT, "request_id", "non-printable")
    for res, rid, local in ((a, "a", [0, 1, 2]), (b, "b", [6, 7])):
        assert isinstance(res, PullResult), res
        assert res.request_id == rid
        assert res.done
        assert res.bytes == len(local) * LAY.page_bytes * LAY.num_layers
    src, dst = pw.buffers["kv"], dw.buffers["kv"]
    for layer in range(LAY.num_layers):
        assert np.array_equal(dst.pages(layer)[[0, 1, 2]], src.pages(layer)[[1, 2, 3]])
        assert np.array_equal(dst.pages(layer)[[6, 7]], src.pages(layer)[[10, 11]])
    # The pulls that got as far as a lookup (a, nope, c, b) asked the publisher together: "c", which
    # names its remote ids, reads ahead of its lookup, which may then leave on its own.
    assert sum(lookups.sizes) + len(singles.sizes) == 4
    assert len(lookups.sizes) + len(singles.sizes) <= 2
    # Done pulls released what they asked for (notices are sent after the answer, so wait for them);
    # "e" was never asked for and "c" failed on its own input before any READ: both are still held.
    for _ in range(500):
        if (await pw.client.status())["leases"] == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert (await pw.client.status())["leases"] == 2
    res = await dw.pull("e", [p], {"kv": [11]})
    assert res.bytes == LAY.page_bytes * LAY.num_layers
    assert dw.verify({"kv": [11]}, 43) == (LAY.page_bytes * LAY.num_layers, 0)


async def test_pull_batch_refuses_empty_and_oversized_batches(harness: Harness) -> None:
    p, pw, _d, dw = await _pair(harness)
    await expect_error(OK.INVALID_ARGUMENT, dw.client.pull_batch([]), "pulls: 0 pulls in one PullBatch; give 1 to 1024")
    many = [_item(f"r{i}", p, [i % 64]) for i in range(1025)]
    await expect_error(OK.INVALID_ARGUMENT, dw.client.pull_batch(many), "pulls: 1025 pulls in one PullBatch")
    await transfer([pw], [p], [dw], "after", {"kv": [5, 6]}, {"kv": [7, 8]}, salt=9)


async def test_get_published_batch_tells_nothing_to_a_stranger(harness: Harness) -> None:
    p, pw, _d, _dw = await _pair(harness)
    await pw.prefill("known", {"kv": [1, 2]}, salt=5)
    ch = grpc.aio.insecure_channel(p.peer_address)
    try:
        stub = peer_pb2_grpc.PeerStub(ch)
        rank = common_pb2.Rank(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)

        def ask(rid: str) -> Any:
            return peer_pb2.GetPublishedRequest(request_id=rid, engine_id="stranger", instance_id="x", rank=rank)

        resp = await stub.GetPublishedBatch(peer_pb2.GetPublishedBatchRequest(requests=[ask("known"), ask("gone")]))
        known, gone = resp.results
        assert known.code == OK.FAILED_PRECONDITION.value[0]
        assert "reader 'stranger' (instance x) has not handshaken" in known.message
        assert not known.HasField("response")  # no block ids, no regions
        # Not even whether a request is published: the unknown one is refused alike.
        assert (gone.code, gone.message, gone.reason) == (known.code, known.message, known.reason)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetPublishedBatch(peer_pb2.GetPublishedBatchRequest(requests=[ask("known")] * 1025))
        assert info.value.code() == OK.INVALID_ARGUMENT
        assert "requests: 1025 lookups in one GetPublishedBatch; at most 1024" in (info.value.details() or "")
    finally:
        await ch.close()
    assert (await pw.client.status())["leases"] == 1  # still held for a real reader


async def test_lookups_fall_back_to_single_calls_for_a_peer_without_batches(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, pw, _d, dw = await _pair(harness)
    assert p.core is not None

    refused: list[int] = []

    async def unimplemented(req: Any, *_creds: Any) -> Any:
        # FAKE: stands in for a kvxfer release that predates GetPublishedBatch (gRPC answers such a
        # peer's unknown method with UNIMPLEMENTED); nothing else can produce an older peer here.
        refused.append(len(req.requests))
        err = KvxferError("Method not found!", reason=Reason.UNSUPPORTED)  # what a bare UNIMPLEMENTED reads as
        err.status = "UNIMPLEMENTED"  # type: ignore[misc]
        raise err

    monkeypatch.setattr(p.core, "peer_get_published_batch", unimplemented)
    singles = CallCounter(monkeypatch, p, "peer_get_published")
    for i in range(6):
        await pw.prefill(f"r{i}", {"kv": [i + 1]}, salt=20 + i)
    dw.poison({"kv": [10 + i for i in range(6)]})
    for first, n in ((0, 4), (4, 2)):
        results = await dw.client.pull_batch([_item(f"r{i}", p, [10 + i]) for i in range(first, first + n)])
        assert all(isinstance(r, PullResult) for r in results), results
    assert refused == [4]  # asked once; the second batch went straight to single calls
    assert singles.sizes == [1] * 6
    for i in range(6):
        assert dw.verify({"kv": [10 + i]}, 20 + i) == (LAY.page_bytes * LAY.num_layers, 0)


async def test_many_lookups_to_one_publisher_go_in_bounded_batches(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = attention(blocks=256)
    ps, pws, _ds, dws = await harness.deployment({"kv": lay}, {"kv": lay})
    p, pw, dw = ps[0], pws[0], dws[0]
    await transfer([pw], [p], [dw], "warm", {"kv": [255]}, {"kv": [255]}, salt=3)
    for i in range(70):
        await pw.prefill(f"r{i}", {"kv": [i]}, salt=100 + i)
    lookups = CallCounter(monkeypatch, p, "peer_get_published_batch")
    dw.poison({"kv": list(range(100, 170))})
    results = await dw.client.pull_batch([_item(f"r{i}", p, [100 + i]) for i in range(70)])
    assert all(isinstance(r, PullResult) for r in results), results
    # Answers carry block ids, so one call takes at most 64 lookups (LOOKUPS_PER_CALL).
    assert sorted(lookups.sizes) == [6, 64]
    for i in range(70):
        assert dw.verify({"kv": [100 + i]}, 100 + i) == (lay.page_bytes * lay.num_layers, 0)


async def test_pull_batch_is_refused_where_pull_is_by_role_and_drain(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    pw = await harness.worker(p, {"kv": LAY})
    await pw.prefill("r1", {"kv": [1, 2]}, salt=1)
    # A prefill-only sidecar pulls nothing, alone or in a batch: the same status, reason and field.
    other = await harness.sidecar(role="prefill", engine_id="prefill-2")
    ow = await harness.worker(other, {"kv": LAY})
    err = await expect_error(OK.FAILED_PRECONDITION, ow.client.pull_batch([_item("r1", p, [3, 4])]), "--role prefill")
    assert (err.reason, err.field) == (Reason.WRONG_ROLE, "role")
    # A draining sidecar starts no new pull, alone or in a batch.
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": LAY})
    await pw.prefill("r2", {"kv": [5, 6]}, salt=2)
    await dw.client.drain(0.5)
    err = await expect_error(OK.UNAVAILABLE, dw.client.pull_batch([_item("r2", p, [3, 4])]), "draining")
    assert (err.reason, err.field) == (Reason.DRAINING, "draining")
    assert (await dw.client.status())["transfers_in_flight"] == 0
    assert (await pw.client.status(publishes=["r2"]))["publishes"], "the refused batch must not have read r2"


async def test_an_item_the_client_cannot_send_fails_alone(harness: Harness) -> None:
    """``spans`` without ``remote_blocks`` raised a plain ValueError while building the batch: the whole
    PullBatch failed, no pull ran, and no status or reason said which field. That item now gets its own
    INVALID_ARGUMENT (field ``spans``, reason INVALID_FIELD) and the others run; ``pull`` raises the same."""
    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await pw[0].prefill("good", {"kv": [1, 2]}, salt=3)
    half = {"kv": TokenSpan(LAY.block_size, 0, 0)}
    results = await dw[0].client.pull_batch([
        PullItem("spans-alone", [ps[0].peer_address], {"kv": [5]}, spans=half),
        PullItem("good", [ps[0].peer_address], {"kv": [6, 7]}),
    ])  # fmt: skip
    bad, good = results
    assert isinstance(bad, KvxferRpcError), bad
    assert (bad.code, bad.reason, bad.field) == (OK.INVALID_ARGUMENT, Reason.INVALID_FIELD, "spans")
    assert "remote_blocks" in bad.details
    assert isinstance(good, PullResult)
    assert dw[0].verify({"kv": [6, 7]}, 3)[1] == 0
    err = await expect_error(OK.INVALID_ARGUMENT, dw[0].client.pull("r", [ps[0].peer_address], {"kv": [5]},
                                                                    spans=half), "spans", "remote_blocks")  # fmt: skip
    assert (err.reason, err.field) == (Reason.INVALID_FIELD, "spans")
    # A batch of such items only is answered without a call.
    (only,) = await dw[0].client.pull_batch([PullItem("x", [ps[0].peer_address], {"kv": [5]}, spans=half)])
    assert isinstance(only, KvxferRpcError)
    assert only.field == "spans"


@pytest.mark.parametrize("deadline", [0.0, -1.0, float("nan"), float("inf")])
async def test_a_deadline_that_is_no_positive_time_is_refused_naming_it(harness: Harness, deadline: float) -> None:
    """``deadline=0`` silently became the client's 30 s timeout on a call (``deadline or self.timeout``) and
    the sidecar's --transfer-timeout-seconds on a pull (timeout_seconds 0), while a negative one was
    refused. Every deadline that is no finite number of seconds > 0 is now refused, naming ``deadline``
    and the value, on a call, a pull and one item of a batch (the others run)."""
    ps, pw, _ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY})
    client = dw[0].client
    address = ps[0].peer_address
    await pw[0].prefill("r", {"kv": [1]}, salt=2)
    shown = str(deadline)
    err = await expect_error(OK.INVALID_ARGUMENT, client.status(deadline=deadline), "deadline", shown)
    assert (err.reason, err.field) == (Reason.INVALID_FIELD, "deadline")
    err = await expect_error(OK.INVALID_ARGUMENT, client.pull("r", [address], {"kv": [3]}, deadline=deadline),
                             "deadline", shown)  # fmt: skip
    assert (err.reason, err.field) == (Reason.INVALID_FIELD, "deadline")
    bad, good = await client.pull_batch([PullItem("r", [address], {"kv": [3]}, deadline=deadline),
                                         PullItem("r", [address], {"kv": [4]}, deadline=5.0)])  # fmt: skip
    assert isinstance(bad, KvxferRpcError)
    assert (bad.code, bad.field) == (OK.INVALID_ARGUMENT, "deadline")
    assert isinstance(good, PullResult)
    assert dw[0].verify({"kv": [4]}, 2)[1] == 0
