"""Busy polling: the sidecar's event loop keeps polling while hot calls come fast, or for a while after each.

``--busy-poll-above-rate`` (500 calls a second by default): while the calls on the fast socket or
the peer frames listener come faster than that, the loop keeps turning without sleeping, and
sleeps again once they slow down. ``--busy-poll-seconds`` (off by default): each call keeps it
polling for that window, whatever the rate. How much that saves is measured by
``bench/load.py --sidecar-env KVXFER_BUSY_POLL_ABOVE_RATE=...`` and
``bench/gpu/sidecar_vram_bench.py --sidecar-env KVXFER_BUSY_POLL_SECONDS=...``, not here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvxfer.config import ConfigError, load_settings
from kvxfer.server.busy_poll import (
    MIN_POLL_CPU_CORES,
    MIN_POLL_HOST_CORES,
    RATE_WINDOW_GAPS,
    BusyPoll,
    rate_under_limit,
)
from kvxfer.server.cpu_room import cpu_limit_cores, host_cores
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


async def test_calls_faster_than_the_rate_keep_it_polling_until_they_slow_down() -> None:
    poll = BusyPoll(asyncio.get_running_loop(), 0.0, rate=100.0)  # polls while the mean gap is under 10 ms
    assert poll.mean_gap == pytest.approx(RATE_WINDOW_GAPS / 100.0)  # as after an idle spell
    for _ in range(5):  # fast, but too few to bring the mean under 10 ms: a handful of calls is no rate
        poll.poke()
    assert (poll.on, poll.polls) == (False, 0)
    for _ in range(10):
        poll.poke()
    assert poll.mean_gap < 0.01
    assert poll.on
    await asyncio.sleep(0.02)  # within RATE_WINDOW_GAPS gaps at the rate (40 ms) of the last call
    assert poll.on
    assert poll.polls > 5
    await asyncio.sleep(0.1)
    assert not poll.on  # no call for longer than the window: it sleeps again
    stopped = poll.polls
    # Calls slower than the rate (a gap of 15 ms each) never turn it on, however many.
    slow = BusyPoll(asyncio.get_running_loop(), 0.0, rate=100.0)
    for _ in range(8):
        slow.poke()
        await asyncio.sleep(0.015)
    assert (slow.on, slow.polls) == (False, 0)
    assert slow.mean_gap > 0.01
    assert poll.polls == stopped


async def test_a_zero_rate_never_polls() -> None:
    poll = BusyPoll(asyncio.get_running_loop(), 0.0, rate=0.0)
    for _ in range(100):
        poll.poke()
    await asyncio.sleep(0.01)
    assert (poll.on, poll.polls) == (False, 0)


def test_a_negative_rate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rate: must be >= 0 calls a second, got -5"):
        BusyPoll(asyncio.new_event_loop(), 0.0, rate=-5.0)
    with pytest.raises(ConfigError) as info:
        load_settings({"busy_poll_above_rate": -1}, env={})
    assert info.value.field == "busy_poll_above_rate"
    assert "-1" in info.value.message
    assert load_settings({}, env={}).busy_poll_above_rate == 500.0  # on by default


async def test_a_burst_of_expects_turns_it_on_and_the_sidecar_sleeps_after(harness: Harness) -> None:
    ps, pw, ds, dw = await harness.deployment({"kv": LAY}, {"kv": LAY}, busy_poll_above_rate=50.0)
    decode = ds[0].busy_poll
    assert decode is not None
    assert (decode.window, decode.rate) == (0.0, 50.0)
    await asyncio.sleep(0.3)
    assert not decode.on
    for i in range(30):  # one after the other on the fast socket: each a round trip well under 20 ms
        await pw[0].prefill(f"b{i}", {"kv": [1]}, salt=i)
        assert await dw[0].client.expect(f"b{i}", [ps[0].peer_address])
    assert decode.on
    assert decode.mean_gap < 0.02
    await asyncio.sleep(0.3)  # past RATE_WINDOW_GAPS gaps at 50 a second (80 ms) after the last
    assert not decode.on
    polled = decode.polls
    assert polled > 0
    await asyncio.sleep(0.05)
    assert decode.polls == polled


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
    """No window by default, and a pull now and then is no rate: the sidecar sleeps between them.

    The rate is 500 a second, or 0 where this machine has no core to spare (the 2-core CI machine)."""
    sc = await harness.sidecar()
    assert sc.busy_poll is not None
    want = rate_under_limit(500.0, cpu_limit_cores(), host_cores(), asked=False)[0]
    assert (sc.busy_poll.window, sc.busy_poll.rate) == (0.0, want)
    asked = await harness.sidecar(busy_poll_above_rate=500.0)  # set explicitly: kept on any machine
    assert asked.busy_poll is not None
    assert asked.busy_poll.rate == 500.0
    (_ps, pw, ds, dw) = await harness.deployment({"kv": LAY}, {"kv": LAY})
    await transfer(pw, _ps, dw, "r1", {"kv": [1]}, {"kv": [2]}, salt=1)
    assert ds[0].busy_poll is not None
    assert ds[0].busy_poll.polls == 0


def _cgroups(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "self_cgroup"
    proc.write_text(self_cgroup)
    return root, proc


def test_the_cpu_limit_is_the_tightest_quota_on_the_cgroup_path(tmp_path: Path) -> None:
    # cgroup v2: the pod's limit (1.5 cores) is tighter than the container's own (max) and the node's (8).
    root, proc = _cgroups(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "800000 100000\n",
        "kubepods/pod1/cpu.max": "150000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "max 100000\n",
    })  # fmt: skip
    assert cpu_limit_cores(root, proc) == 1.5
    root, proc = _cgroups(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpu_limit_cores(root, proc) is None
    # cgroup v1, as a container sees it: its own cgroup is the cpu controller's mount.
    root, proc = _cgroups(tmp_path / "v1", "3:cpu,cpuacct:/kubepods/pod1/ctr\n0::/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cpu_limit_cores(root, proc) == 0.5
    root, proc = _cgroups(tmp_path / "v1none", "3:cpu,cpuacct:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cpu_limit_cores(root, proc) is None
    assert cpu_limit_cores(tmp_path / "missing", tmp_path / "missing-self") is None  # nothing to read: no limit


def test_polling_above_the_rate_stays_off_by_default_without_a_core_to_spare() -> None:
    assert rate_under_limit(500.0, None, 16, asked=False) == (500.0, "")
    assert rate_under_limit(500.0, 2.0, 16, asked=False) == (500.0, "")
    assert rate_under_limit(0.0, 0.5, 2, asked=False) == (0.0, "")
    rate, why = rate_under_limit(500.0, 1.0, 16, asked=False)
    assert rate == 0.0
    assert why.startswith("this container's CPU limit is 1 cores, below 1.5")
    rate, why = rate_under_limit(500.0, None, 2, asked=False)  # a small host, shared with the workers
    assert rate == 0.0
    assert why.startswith("this process may run on 2 CPUs, fewer than 4")
    rate, why = rate_under_limit(800.0, 1.0, 16, asked=True)  # asked for: kept, with the reason as a warning
    assert (rate, bool(why)) == (800.0, True)
    assert (MIN_POLL_CPU_CORES, MIN_POLL_HOST_CORES) == (1.5, 4)
    assert host_cores() >= 1
