"""kvxfer.server.unsettled: which failed pulls may still have bytes landing, on a clock the test moves."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kvxfer.server.unsettled import UnsettledPulls
from kvxfer.transport import UnfencedOp


def test_a_pull_is_unsettled_until_every_operation_it_left_ended_or_the_hold_ran_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    looked = []
    pulls = UnsettledPulls(30.0, lambda: looked.append(now[0]), clock=lambda: now[0])
    assert pulls.still(["a"]) == []
    assert looked == []  # nothing kept: the data plane is not asked
    a1, a2, b = UnfencedOp("READ", "p0"), UnfencedOp("READ", "p1"), UnfencedOp("READ", "p0", watched=False)
    pulls.add("a", [a1])
    pulls.add("a", [a2])  # a second failure of the same id adds to the first (each held from its own)
    pulls.add("b", [b])
    pulls.add("c", [])  # nothing known to watch: held for the hold
    assert pulls.still(["a", "b", "c", "z"]) == ["a", "b", "c"]
    assert looked == [100.0]
    a1.ended = True
    assert pulls.still(["a"]) == ["a"]  # a2 has not ended
    a2.ended = True
    assert pulls.still(["a", "b"]) == ["b"]
    assert len(pulls) == 2
    now[0] = 129.9
    assert pulls.still(["b", "c"]) == ["b", "c"]
    now[0] = 130.0
    with caplog.at_level("ERROR", logger="kvxfer.server.unsettled"):
        assert pulls.still(["b", "c"]) == []
    assert len(pulls) == 0
    assert sum("not seen to end within --unfenced-hold-seconds" in r.getMessage() for r in caplog.records) == 2


def test_a_later_failure_of_the_same_id_is_held_from_its_own_failure_and_old_ones_are_let_go() -> None:
    """A pull id that fails unfenced again long after its first failure (nobody asked meanwhile) is held for
    the hold from the second failure: the first one's clock let its operation go at once. Pulls nobody asks
    about are let go once their hold ran out, without waiting for a GetStatus (they piled up forever, and the
    kvxfer_unsettled_pulls gauge with them)."""
    now = [100.0]
    pulls = UnsettledPulls(30.0, lambda: None, clock=lambda: now[0])
    pulls.add("a", [UnfencedOp("READ", "p0", watched=False)])
    pulls.add("old", [UnfencedOp("READ", "p0", watched=False)])
    now[0] = 500.0
    pulls.add("a", [UnfencedOp("READ", "p0", watched=False)])  # a new pull of "a", into other blocks
    assert len(pulls) == 1  # "old" and the first "a" ran out their hold
    assert pulls.still(["a", "old"]) == ["a"]
    now[0] = 529.9
    assert pulls.still(["a"]) == ["a"]
    now[0] = 530.0
    assert pulls.still(["a"]) == []


def test_the_count_lets_go_of_what_ended_or_ran_out_without_anyone_asking() -> None:
    """The kvxfer_unsettled_pulls gauge counts from the metrics thread without asking the data plane: a pull
    whose operations ended, or whose hold ran out, no longer counts even if no GetStatus asked (it stayed up)."""
    now = [0.0]
    pulls = UnsettledPulls(10.0, lambda: None, clock=lambda: now[0])
    ended, stuck = UnfencedOp("READ", "p0"), UnfencedOp("READ", "p1")
    pulls.add("a", [ended])
    pulls.add("b", [stuck])
    assert len(pulls) == 2
    ended.ended = True
    assert len(pulls) == 1
    now[0] = 10.0
    assert len(pulls) == 0


async def test_held_pulls_are_looked_at_again_without_anyone_asking(caplog: pytest.LogCaptureFixture) -> None:
    """In an event loop, what is held is looked at every interval with no GetStatus: an operation the data
    plane saw end lets its pull go, a hold that runs out is logged when it does, and the looking stops once
    nothing is held and the data plane keeps nothing."""
    op_a, op_b = UnfencedOp("READ", "p0"), UnfencedOp("READ", "p1", watched=False)
    library_ended: list[UnfencedOp] = []  # what the library saw end; the look marks it, as NIXL's does
    looks = [0]

    def look() -> int:
        looks[0] += 1
        for op in library_ended:
            op.ended = True
        return sum(op.watched and not op.ended for op in (op_a, op_b))

    pulls = UnsettledPulls(0.6, look, interval_s=0.02)
    pulls.add("a", [op_a])
    pulls.add("b", [op_b])
    await asyncio.sleep(0.15)
    assert looks[0] >= 3
    assert len(pulls) == 2
    library_ended.append(op_a)
    await asyncio.sleep(0.15)
    assert op_a.ended
    assert len(pulls) == 1
    with caplog.at_level("ERROR", logger="kvxfer.server.unsettled"):
        await asyncio.sleep(0.6)  # b's hold ran out
    assert len(pulls) == 0
    assert [r.request_id for r in caplog.records] == ["b"]  # type: ignore[attr-defined]
    n = looks[0]
    await asyncio.sleep(0.1)
    assert looks[0] == n  # nothing held, nothing kept: no more looks
    pulls.close()


def test_outside_an_event_loop_nothing_is_watched() -> None:
    """Held from a thread without a loop (tests, tools): adding works, nothing is scheduled."""
    pulls = UnsettledPulls(1.0, lambda: 0)
    pulls.add("a", [UnfencedOp("READ", "p0")])
    assert pulls._timer is None
    assert len(pulls) == 1


async def test_the_watch_survives_a_failing_look_stops_for_good_once_closed_and_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A look that raises (a library error) is logged and the watch goes on; with no pull held, only the data
    plane keeping an operation, the looks space out (doubling, up to MAX_WATCH_INTERVAL_S); after close()
    nothing schedules a look again, neither a later failure (add) nor the transport's report (watch)."""
    calls: list[float] = []
    fail = [True]

    def look() -> int:
        calls.append(asyncio.get_running_loop().time())
        if fail[0]:
            fail[0] = False
            raise RuntimeError("binding error")
        return 1  # an operation whose peer never answers

    pulls = UnsettledPulls(30.0, look, interval_s=0.02)
    with caplog.at_level("ERROR", logger="kvxfer.server.unsettled"):
        pulls.watch()
        await asyncio.sleep(0.5)
    assert any("looking again" in r.getMessage() for r in caplog.records)
    assert len(calls) >= 3  # it went on after the failure
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps[-1] >= 2.5 * gaps[0]  # spaced out: 0.02, 0.04, 0.08, 0.16...
    assert pulls._timer is not None
    spaced = pulls._timer.when() - asyncio.get_running_loop().time()
    pulls.add("held", [UnfencedOp("READ", "p0")])  # a pull held: looked at again within the interval
    assert pulls._timer is not None
    assert pulls._timer.when() - asyncio.get_running_loop().time() <= 0.02 < spaced
    pulls.close()
    n = len(calls)
    pulls.add("late", [UnfencedOp("READ", "p0")])
    pulls.watch()
    assert pulls._timer is None
    await asyncio.sleep(0.1)
    assert len(calls) == n
