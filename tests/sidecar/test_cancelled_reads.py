"""A READ that ends cancelled without its pull being cancelled fails the pull.

The READs here are stand-in coroutines (a fake, named as such): the one backend that did this
(Mooncake, when a peer was removed under a queued transfer) no longer does, so the fault cannot be
produced with a real data plane any more; the guard stays for any backend that cancels its own waits.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxfer.errors import PeerUnavailableError, Reason
from kvxfer.server.pull_reads import _gather_or_cancel


async def _moved(into: list[str]) -> None:
    await asyncio.sleep(0)
    into.append("moved")


async def _cancelled_by_its_backend() -> None:
    await asyncio.sleep(0)
    raise asyncio.CancelledError


@pytest.mark.parametrize("reads", [1, 3])
async def test_a_read_cancelled_by_its_backend_fails_the_pull(reads: int) -> None:
    done: list[str] = []
    coros = [_moved(done) for _ in range(reads - 1)] + [_cancelled_by_its_backend()]
    with pytest.raises(PeerUnavailableError) as info:
        await _gather_or_cancel(coros)
    assert info.value.reason is Reason.DATA_PLANE
    assert info.value.message.startswith(f"1 of {reads} data plane READs ended cancelled although the pull was not")
    assert done == ["moved"] * (reads - 1)


@pytest.mark.parametrize("reads", [1, 3])
async def test_cancelling_the_pull_still_cancels_its_reads(reads: int) -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(60)

    pull = asyncio.get_running_loop().create_task(_gather_or_cancel([forever() for _ in range(reads)]))
    await started.wait()
    pull.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pull
