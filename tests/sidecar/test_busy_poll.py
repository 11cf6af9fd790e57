"""``--busy-poll-seconds``: the sidecar's event loop keeps polling for a while after each hot call.

Off by default (an idle sidecar sleeps); on, a frame on the fast socket or the peer frames listener
keeps the loop turning without sleeping for the window, then it sleeps again. How much that saves
is measured by ``bench/gpu/sidecar_vram_bench.py --sidecar-env KVXFER_BUSY_POLL_SECONDS=...``, not here.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxfer.config import ConfigError, load_settings
from kvxfer.server.busy_poll import BusyPoll
from tests.sidecar.helpers import Harness, attention, transfer

LAY = attention()


async def test_a_poke_keeps_the_loop_polling_for_the_window_then_it_sleeps() -> None:
    poll = BusyPoll(asyncio.get_running_loop(), 0.1)
    assert not poll.on
    assert poll.polls == 0
    poll.poke()
    assert poll.on
    await asyncio.sleep(0.03)  # a timer: without the poll the loop would sleep through it in one turn
    assert poll.on
    assert poll.polls > 10
    poll.poke()  # extends the window, without a second callback
    await asyncio.sleep(0.3)
    assert not poll.on
    stopped = poll.polls
    await asyncio.sleep(0.05)
    assert poll.polls == stopped  # no callback left: the loop sleeps again


async def test_a_zero_window_never_polls() -> None:
    poll = BusyPoll(asyncio.get_running_loop(), 0.0)
    poll.poke()
    await asyncio.sleep(0.02)
    assert (poll.on, poll.polls) == (False, 0)


def test_a_negative_window_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="window: must be >= 0 seconds, got -1"):
        BusyPoll(asyncio.new_event_loop(), -1.0)
    with pytest.raises(ConfigError) as info:
        load_settings({"busy_poll_seconds": -0.5}, env={})
    assert info.value.field == "busy_poll_seconds"
    assert "-0.5" in info.value.message
    assert load_settings({}, env={}).busy_poll_seconds == 0.0  # off by default


async def test_hot_calls_turn_it_on_and_an_idle_sidecar_sleeps(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, busy_poll_seconds=0.5)
    decode, prefill = ds[0].busy_poll, ps[0].busy_poll
    assert decode is not None
    assert prefill is not None
    assert decode.window == 0.5
    await asyncio.sleep(0.6)  # registration's calls are behind us
    assert not decode.on
    assert not prefill.on
    (res,) = await transfer(pw, ps, dw, "r1", {"kv": [5, 6, 7]}, {"kv": [9, 3, 4]}, salt=5)
    assert res.done
    assert res.bytes == 3 * LAY.page_bytes * LAY.num_layers
    # The worker's Pull came as a frame to the decode sidecar, its lookup as a peer frame to the
    # prefill sidecar: both loops poll now, and sleep again once the window has passed.
    assert decode.on
    assert prefill.on
    await asyncio.sleep(0.8)
    assert not decode.on
    assert not prefill.on
    polled = decode.polls
    await asyncio.sleep(0.05)
    assert decode.polls == polled


async def test_off_by_default(harness: Harness) -> None:
    sc = await harness.sidecar()
    assert sc.busy_poll is not None
    assert sc.busy_poll.window == 0.0
    (_ps, pw, ds, dw) = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await transfer(pw, _ps, dw, "r1", {"kv": [1]}, {"kv": [2]}, salt=1)
    assert ds[0].busy_poll is not None
    assert ds[0].busy_poll.polls == 0
