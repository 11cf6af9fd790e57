"""Leases that follow the reader: a decode side that waits longer than the lease still pulls exactly."""

from __future__ import annotations

import asyncio

import grpc

from tests.sidecar.helpers import Harness, attention, expect_error

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


async def test_expect_is_checked_like_a_pull(harness: Harness) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    c = dw[0].client
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.expect("r", []), "remote_addresses: give the peer API")
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, c.expect("", [ps[0].peer_address]), "request_id")
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, pw[0].client.expect("r", [ps[0].peer_address]),
                       "--role prefill")  # fmt: skip
