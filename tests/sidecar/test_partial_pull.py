"""A reader pulls part of a publish (the tail its own prefix cache lacks); ids never published are refused."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from tests.sidecar.helpers import Harness, attention, expect_error

PUBLISHED = [5, 6, 7, 1, 30, 31, 12, 40]


async def test_pull_a_tail_of_the_published_blocks(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("r1", {"kv": PUBLISHED}, salt=11)
    tail, local = PUBLISHED[3:], [20, 21, 22, 23, 24]
    untouched = [0, 2, 3]  # local blocks outside the pull keep their poison
    dw[0].poison({"kv": untouched})
    before = {layer: dw[0].buffers["kv"].pages(layer)[untouched].copy() for layer in range(lay.num_layers)}
    res = await dw[0].pull("r1", ps, {"kv": local}, remote_blocks={"kv": tail})
    assert res.bytes == len(tail) * lay.page_bytes * lay.num_layers
    src, dst = pw[0].buffers["kv"], dw[0].buffers["kv"]
    for layer in range(lay.num_layers):
        assert np.array_equal(dst.pages(layer)[local], src.pages(layer)[tail])
        assert np.array_equal(dst.pages(layer)[untouched], before[layer])
    # 1 (alone), 30-31, 12, 40 are runs on the prefill side against 20..24 here: 4 descriptors per layer.
    assert res.descriptors == 4 * lay.num_layers


async def test_pull_of_an_unpublished_id_is_refused(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("r1", {"kv": PUBLISHED}, salt=12)
    await pw[0].prefill("r2", {"kv": [50, 51]}, salt=13)
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        dw[0].pull("r1", ps, {"kv": [1, 2]}, remote_blocks={"kv": [7, 8]}),
        "remote_blocks[kv]: block id 8 at position 1 was not published",
        "published 8 blocks",
    )
    # The mistake was the caller's and nothing was read: r1 stays published (both leases held), a
    # block-count mismatch is refused the same way, and the corrected retries move exactly.
    assert (await pw[0].client.status())["leases"] == 2
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        dw[0].pull("r1", ps, {"kv": [1, 2, 3]}, remote_blocks={"kv": [7, 6]}),
        "remote_blocks[kv]: length mismatch: 3 local blocks",
    )
    assert (await pw[0].client.status())["leases"] == 2
    src, dst = pw[0].buffers["kv"], dw[0].buffers["kv"]
    res = await dw[0].pull("r1", ps, {"kv": [1, 2]}, remote_blocks={"kv": [7, 6]})
    for layer in range(lay.num_layers):
        assert np.array_equal(dst.pages(layer)[[1, 2]], src.pages(layer)[[7, 6]])
    res = await dw[0].pull("r2", ps, {"kv": [3, 4]}, remote_blocks={"kv": [51, 50]})
    for layer in range(lay.num_layers):
        assert np.array_equal(dst.pages(layer)[[3, 4]], src.pages(layer)[[51, 50]])
    assert res.bytes == 2 * lay.page_bytes * lay.num_layers


async def test_a_reader_that_needs_nothing_frees_the_publish_at_once(harness: Harness) -> None:
    # The decode side's prefix cache covered a whole prompt: it pulls nothing, and tells the prefill
    # side so, instead of leaving the blocks held until the lease expires.
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, lease_seconds=600)
    await pw[0].prefill("r1", {"kv": PUBLISHED}, salt=14)
    await pw[0].prefill("r2", {"kv": [50, 51]}, salt=15)
    # The decode sidecar has never talked to the publisher: it handshakes first.
    assert await dw[0].client.drop_remote("r1", [ps[0].peer_address], "covered by the local prefix cache") == 1
    ev = await asyncio.wait_for(anext(pw[0].client.watch_completions(replay=True)), 10)
    assert (ev.kind, ev.request_id) == ("ABORTED", "r1")
    assert "covered by the local prefix cache" in ev.message
    assert (await pw[0].client.status())["leases"] == 1
    await expect_error(grpc.StatusCode.NOT_FOUND, dw[0].pull("r1", ps, {"kv": [1]}, remote_blocks={"kv": [5]}),
                       "'r1' is not published")  # fmt: skip
    # Nothing held under that id any more, or never: nothing dropped, no error.
    assert await dw[0].client.drop_remote("r1", [ps[0].peer_address]) == 0
    # Bad input is refused before anything happens; r2 still moves exactly.
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.drop_remote("r2", ["no-port"]),
                       "remote_addresses[0]")  # fmt: skip
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, pw[0].client.drop_remote("r2", [ds[0].peer_address]),
                       "needs role decode")  # fmt: skip
    res = await dw[0].pull("r2", ps, {"kv": [1, 2]})
    assert res.bytes == 2 * lay.page_bytes * lay.num_layers
    assert dw[0].verify({"kv": [1, 2]}, 15) == (2 * lay.page_bytes * lay.num_layers, 0)
