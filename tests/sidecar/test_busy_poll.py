"""Busy polling (``--busy-poll-ms``): the event loop kept awake for a window after each incoming call.

The unit tests drive :class:`kvxfer.server.busy_poll.BusyPoll` with a clock of their own; the sidecar
tests check which calls open a window (a worker's frame on the fast socket, a worker's gRPC call, a
peer's call), that the loop really turns without sleeping while it is open, and what the counter says.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from kvxfer.client import AsyncClient
from kvxfer.config import ConfigError, load_settings
from kvxfer.server.app import Sidecar
from kvxfer.server.busy_poll import BusyPoll
from tests.sidecar.helpers import Harness, attention, transfer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_window_lasts_from_the_last_poke_and_reports_its_length() -> None:
    clock, spent = _Clock(), []
    bp = BusyPoll(1.0, spent=spent.append, clock=clock)
    assert not bp.active
    bp.poke()
    assert bp.active
    await _turns(5)
    assert bp.turns >= 4
    assert bp.active
    clock.now = 100.6
    bp.poke()  # extends the window to 101.6, opens no second one
    clock.now = 101.5
    before = bp.turns
    await _turns(5)
    assert bp.active
    assert bp.turns >= before + 4
    assert spent == []
    clock.now = 101.7
    await _turns(3)
    assert not bp.active
    assert spent == [pytest.approx(1.7)]  # from the first poke to the turn that saw it end
    settled = bp.turns
    await _turns(3)
    assert bp.turns == settled  # nothing left scheduled: the loop may sleep again


async def test_a_zero_window_schedules_nothing_and_a_negative_one_is_refused() -> None:
    bp = BusyPoll(0.0)
    bp.poke()
    await _turns(3)
    assert (bp.active, bp.turns) == (False, 0)
    with pytest.raises(ValueError, match=r"busy_poll window must be >= 0 s, got -0\.5"):
        BusyPoll(-0.5)


def test_the_setting_is_checked_and_named() -> None:
    assert load_settings({}, env={}).busy_poll_ms == 0.0
    assert load_settings({"busy_poll_ms": "2.5"}, env={}).busy_poll_ms == 2.5
    with pytest.raises(ConfigError, match=r"--busy-poll-ms: .*greater than or equal to 0") as info:
        load_settings({"busy_poll_ms": -1}, env={})
    assert info.value.field == "busy_poll_ms"
    with pytest.raises(ConfigError, match=r"KVXFER_BUSY_POLL_MS: .*less than or equal to 10000"):
        load_settings({}, env={"KVXFER_BUSY_POLL_MS": "20000"})


def _counter(sidecar: Sidecar) -> float:
    assert sidecar.metrics is not None
    found = re.search(r"^kvxfer_busy_poll_seconds_total (\S+)$", sidecar.metrics.exposition().decode(), re.M)
    assert found is not None
    return float(found.group(1))


async def test_each_kind_of_call_opens_a_window_in_which_the_loop_never_sleeps(harness: Harness) -> None:
    lay = attention()
    window = 0.15
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, busy_poll_ms=window * 1e3)
    p, d = ps[0], ds[0]
    await asyncio.sleep(window + 0.1)  # the registrations' windows have closed
    assert not p.busy_poll.active
    assert not d.busy_poll.active
    # A pull over the fast socket: the decode sidecar's window opens with the worker's frame, the
    # prefill sidecar's with the peer's lookup (the publish opened it first, on the worker's frame).
    await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    assert d.fast_api is not None
    assert d.fast_api.calls_started > 0
    assert d.busy_poll.active
    assert p.busy_poll.active
    turns = d.busy_poll.turns
    await asyncio.sleep(0.05)  # a sleeping test task; the loop keeps turning for the window
    assert d.busy_poll.turns - turns >= 50, "the loop slept inside a busy-poll window"
    await asyncio.sleep(window + 0.05)
    assert not d.busy_poll.active
    assert not p.busy_poll.active
    assert _counter(d) >= window
    assert _counter(p) >= window
    # A worker's gRPC call (no fast socket) opens one too.
    grpc_only = AsyncClient(d.local_target, fast=False)
    try:
        spent = _counter(d)
        await grpc_only.status()
        assert d.busy_poll.active
        await asyncio.sleep(window + 0.05)
        assert _counter(d) - spent >= window
    finally:
        await grpc_only.close()
    # Nothing arrives: no window opens, the counter stays put.
    spent_d, turns_d = _counter(d), d.busy_poll.turns
    await asyncio.sleep(0.1)
    assert (_counter(d), d.busy_poll.turns) == (spent_d, turns_d)


async def test_off_by_default_no_window_ever_opens(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await transfer(pw, ps, dw, "r1", {"kv": [1, 2]}, {"kv": [3, 4]}, salt=1)
    for s in (*ps, *ds):
        assert (s.busy_poll.active, s.busy_poll.turns, _counter(s)) == (False, 0, 0.0)
