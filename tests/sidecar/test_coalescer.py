"""The per-peer Coalescer: who is sent with whom, and what each caller gets back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvxfer.server.batching import Coalescer


class Peer:
    """A send function that records its batches and answers when released."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.gate = asyncio.Event()
        self.fail_batch: Exception | None = None
        self.tasks: set[asyncio.Task[Any]] = set()

    async def send(self, key: str, items: list[int]) -> list[Any]:
        self.batches.append((key, list(items)))
        await self.gate.wait()
        if self.fail_batch is not None:
            raise self.fail_batch
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_first_item_goes_alone_and_followers_go_together() -> None:
    peer = Peer()
    c: Coalescer[str, int, int] = Coalescer(peer.send, peer.spawn)
    first = c.submit("a", 0)
    await _settle()
    assert peer.batches == [("a", [0])]  # sent at once: no timer
    later = [c.submit("a", i) for i in (2, 3, 4)]
    other = c.submit("b", 6)  # another peer is not held up by "a"
    await _settle()
    assert peer.batches == [("a", [0]), ("b", [6])]
    assert c.pending("a") == 3
    peer.gate.set()
    assert await first == 0
    assert await other == 60
    assert await later[0] == 20
    with pytest.raises(ValueError, match="odd 3"):  # only its own item fails
        await later[1]
    assert await later[2] == 40
    assert peer.batches == [("a", [0]), ("b", [6]), ("a", [2, 3, 4])]


async def test_cancelled_items_are_not_sent_and_a_failed_send_fails_its_batch() -> None:
    peer = Peer()
    c: Coalescer[str, int, int] = Coalescer(peer.send, peer.spawn)
    first = c.submit("a", 0)
    await _settle()
    gone, kept = c.submit("a", 2), c.submit("a", 4)
    gone.cancel()
    peer.fail_batch = ConnectionError("peer down")
    peer.gate.set()
    for fut in (first, kept):
        with pytest.raises(ConnectionError, match="peer down"):
            await fut
    assert peer.batches == [("a", [0]), ("a", [4])]
    # The peer is back: the next item is sent on its own again.
    peer.fail_batch = None
    assert await c.submit("a", 8) == 80
    assert c.pending("a") == 0


async def test_a_send_that_answers_the_wrong_count_or_is_cancelled_from_below_fails_its_batch_only() -> None:
    calls: list[list[int]] = []

    async def send(_key: str, items: list[int]) -> list[Any]:
        calls.append(list(items))
        if items[0] == 1:
            return [10]  # one result for two items: a peer answering the wrong count
        if items[0] == 3:
            raise asyncio.CancelledError  # e.g. grpc.aio cancelling a call whose channel was reset
        return [i * 10 for i in items]

    tasks: set[asyncio.Task[Any]] = set()
    c: Coalescer[str, int, int] = Coalescer(send, lambda coro: tasks.add(asyncio.ensure_future(coro)))
    wrong = [c.submit("a", 1), c.submit("a", 2)]
    for fut in wrong:
        with pytest.raises(RuntimeError, match="1 results for a batch of 2"):
            await asyncio.wait_for(fut, 5)  # settled, not left pending
    with pytest.raises(RuntimeError, match="the call was cancelled"):
        await asyncio.wait_for(c.submit("a", 3), 5)
    # The queue keeps working: nothing cancelled the sender for good.
    assert await asyncio.wait_for(c.submit("a", 5), 5) == 50
    assert calls == [[1, 2], [3], [5]]


async def test_a_batch_never_exceeds_max_batch_and_the_rest_goes_next() -> None:
    peer = Peer()
    c: Coalescer[str, int, int] = Coalescer(peer.send, peer.spawn, max_batch=3)
    first = c.submit("a", 0)
    await _settle()
    queued = [c.submit("a", i) for i in range(2, 16, 2)]  # 7 items pile up behind the first call
    peer.gate.set()
    assert await first == 0
    assert [await f for f in queued] == [i * 10 for i in range(2, 16, 2)]
    assert peer.batches == [("a", [0]), ("a", [2, 4, 6]), ("a", [8, 10, 12]), ("a", [14])]


async def test_a_lingering_first_item_waits_for_company_then_the_rest_go_as_before() -> None:
    peer = Peer()
    peer.gate.set()
    c: Coalescer[str, int, int] = Coalescer(peer.send, peer.spawn, linger=0.3)
    first = c.submit("a", 0)
    await _settle()
    assert peer.batches == []  # the key was idle: it waits instead of going alone
    company = [c.submit("a", i) for i in (2, 4)]
    assert await asyncio.wait_for(first, 1) == 0
    assert [await f for f in company] == [20, 40]
    assert peer.batches == [("a", [0, 2, 4])]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await c.submit("a", 6) == 60  # idle again: the next one lingers too
    assert loop.time() - t0 >= 0.29
    assert peer.batches == [("a", [0, 2, 4]), ("a", [6])]


async def test_items_a_cancelled_sender_never_answered_are_reported_lingering_or_in_flight() -> None:
    peer = Peer()
    dropped: list[tuple[str, int]] = []
    c: Coalescer[str, int, int] = Coalescer(peer.send, peer.spawn, linger=0.3,
                                            on_dropped=lambda k, n: dropped.append((k, n)))  # fmt: skip
    lingering = [c.submit("a", i) for i in (0, 2)]
    await _settle()
    (task,) = peer.tasks
    task.cancel()  # the sidecar closes while they wait for company
    await asyncio.gather(task, return_exceptions=True)
    assert all(f.cancelled() for f in lingering)
    assert dropped == [("a", 2)]
    assert peer.batches == []

    in_flight = c.submit("b", 4)
    await asyncio.sleep(0.4)
    assert peer.batches == [("b", [4])]  # sent; the peer has not answered (its gate is shut)
    queued = c.submit("b", 6)
    (task,) = peer.tasks - {t for t in peer.tasks if t.done()}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert in_flight.cancelled()
    assert queued.cancelled()
    assert dropped == [("a", 2), ("b", 1), ("b", 1)]  # the batch in flight, then what queued behind it

    done = Coalescer(peer.send, peer.spawn, on_dropped=lambda k, n: dropped.append((k, n)))
    peer.gate.set()
    assert await done.submit("c", 8) == 80
    await _settle()
    assert dropped == [("a", 2), ("b", 1), ("b", 1)]  # nothing reported when every item was answered


class _Peers:
    """RECORDING STUB of the peer directory: each call the Outbox makes, with the notices in it."""

    metadata = ()

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []  # (method, outcomes)

    async def call(self, address: str, what: str, send: Any) -> Any:
        class Stub:
            def __getattr__(self, name: str) -> Any:
                def record(msg: Any, **_: Any) -> Any:
                    notices = msg.notices if name == "NotifyBatch" else [msg]
                    sent.append((name, [n.outcome for n in notices]))

                return record

        sent = self.sent
        return send(Stub())


async def test_done_notices_linger_and_failed_ones_leave_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.server import outbox
    from kvxfer.server.outbox import Outbox
    from kvxfer.server.state import PullEntry
    from kvxfer.topology import RankInfo
    from kvxfer.wire import peer_pb2

    monkeypatch.setattr(outbox, "NOTICE_LINGER_S", 0.3)  # long enough that no stall of a slow host ends it early
    peers = _Peers()
    box = Outbox(peers, engine_id="decode", instance_id="i1")  # type: ignore[arg-type]

    def entry(rid: str) -> PullEntry:
        return PullEntry(f"t-{rid}", rid, "", ["p:1"], 0.0, 0.0, contacted=["p:1"])

    box.notify_publishers(entry("ok1"), RankInfo(0, 1), "done", "", 10)
    box.notify_publishers(entry("bad"), RankInfo(0, 1), "failed", "the READ failed", 0)
    await _settle()
    # The failure frees a publish nobody finished reading: it must not wait behind the linger (a
    # retry's lookup would overtake it and READ blocks it then frees).
    assert peers.sent == [("Notify", [peer_pb2.NotifyRequest.FAILED])]
    box.notify_publishers(entry("ok2"), RankInfo(0, 1), "done", "", 10)
    await asyncio.sleep(0.6)
    assert peers.sent[1:] == [("NotifyBatch", [peer_pb2.NotifyRequest.DONE] * 2)]  # the two DONEs, together
    await box.close()
