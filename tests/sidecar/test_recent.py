"""RecentMemo against a plain reference: a list of (key, value, when), scanned in full."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.server.recent import RecentMemo

KEPT = 4
SECONDS = 10.0

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.tuples(st.integers(0, 2), st.integers(0, 3)), st.integers(0, 99)),
        st.tuples(st.just("get"), st.tuples(st.integers(0, 2), st.integers(0, 3)), st.just(0)),
        st.tuples(st.just("pop"), st.tuples(st.integers(0, 2), st.integers(0, 3)), st.just(0)),
        st.tuples(st.just("wait"), st.just((0, 0)), st.integers(0, 12)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_it_answers_as_a_full_scan_of_what_was_put_would(script: list[tuple[str, tuple[int, int], int]]) -> None:
    async def run() -> None:
        now = [0.0]
        memo: RecentMemo[tuple[int, int], int] = RecentMemo(kept=KEPT, seconds=SECONDS, group=lambda k: k[0],
                                                            clock=lambda: now[0])  # fmt: skip
        ref: list[tuple[tuple[int, int], int, float]] = []  # oldest first

        def live() -> list[tuple[tuple[int, int], int, float]]:
            return [e for e in ref if e[2] >= now[0] - SECONDS]

        for op, key, arg in script:
            if op == "put":
                ref = [e for e in live() if e[0] != key] + [(key, arg, now[0])]
                ref = ref[-KEPT:]
                memo.put(key, arg)
            elif op == "get":
                want = next((v for k, v, _ in live() if k == key), None)
                assert memo.get(key) == want
            elif op == "pop":
                want = next((v for k, v, _ in live() if k == key), None)
                ref = [e for e in live() if e[0] != key]
                assert memo.pop(key) == want
            else:
                now[0] += arg
            ref = live()
            assert list(memo) == [k for k, _, _ in ref]
            for group in range(3):
                assert sorted(memo.keys_of(group)) == sorted(k for k, _, _ in ref if k[0] == group)
        memo.close()

    asyncio.run(run())


async def test_its_timer_forgets_entries_when_nothing_else_comes() -> None:
    memo: RecentMemo[str, str] = RecentMemo(kept=8, seconds=0.05)
    memo.put("a", "x")
    await asyncio.sleep(0.03)
    memo.put("b", "y")
    await asyncio.sleep(0.04)  # "a" is past its time, "b" is not; nothing accessed the memo
    assert len(memo) == 1
    await asyncio.sleep(0.05)
    assert len(memo) == 0
    memo.close()


def test_it_refuses_a_memo_that_could_hold_nothing() -> None:
    with pytest.raises(ValueError, match="kept must be >= 1"):
        RecentMemo(kept=0, seconds=1.0)
    with pytest.raises(ValueError, match=r"seconds > 0, not 1 and 0\.0"):
        RecentMemo(kept=1, seconds=0.0)
