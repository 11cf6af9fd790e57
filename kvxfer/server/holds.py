"""The decode side's holds: requests it will pull, kept alive at their publishers until the pull starts.

vLLM queues a decode request before it allocates the blocks its KV goes into, and a busy or
just-started decode instance may keep it queued longer than the prefill side's lease. The worker
says so with ``Expect(request_id, remote_addresses)`` when the request arrives; this sidecar then
sends each publisher a peer ``Hold`` for it at once (with any others expected while that Hold is
out, or within :data:`FRESH_HOLD_SPACING_S` of it, going together in the next: its pull may start
within milliseconds and should read on a grant), and again every :func:`hold_period` seconds (a
third of the time a publisher granted, when that is sooner: a publish may carry a lease shorter
than this side's), until the request's Pull starts, it is aborted, a publisher answers that it no
longer holds it, or ``--max-hold-seconds`` have passed. The publisher extends each lease by the
publish's own length (its ``lease_seconds``, else the publisher's ``--lease-seconds``), never past
``--max-hold-seconds`` after the publish. Each publisher's Holds go on their own: one that does
not answer (its host is gone) delays no other's, and a failed Hold is tried again within
:data:`RETRY_HOLD_S`.

**A pull that comes before its first grant.** vLLM allocates a request's blocks, and its workers
pull, in the engine step that found the request's KV remote when nothing else was queued: the
Pull then comes within a millisecond or two of the Expect, while the first Hold is still out (or
still spaced). :meth:`Holds.take` hands the pull that Hold's answer (sending a spaced Hold at
once), and its grant confirms the READs the pull ran ahead of it (:mod:`kvxfer.server.pull_steps`)
rather than a lookup: the Hold left first, so its answer comes first, and neither side handles a
second message.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.config import Settings
from kvxfer.errors import KvxferError, Reason
from kvxfer.logs import get_logger, log_context
from kvxfer.server.outbox import PEER_CALL_SECONDS
from kvxfer.server.peers import PeerDirectory
from kvxfer.server.publisher import MAX_BATCH
from kvxfer.server.state import Due, Grant
from kvxfer.wire import common_pb2, peer_pb2
from kvxfer.wire.convert import ids_array

__all__ = ["Holds", "hold_period"]

log = get_logger("kvxfer.server")

HOLD_BATCH = MAX_BATCH  # request ids in one peer Hold (the publisher refuses more)
#: Newly expected requests are held at once, but at most one such Hold leaves per this many seconds:
#: under load (a request expected every millisecond or so) the ones expected meanwhile go together,
#: halving the Holds both sidecars handle, while a request expected now and then is held at once.
#: A pull that comes before its grant reads ahead of its lookup instead (kvxfer.server.pull_steps).
FRESH_HOLD_SPACING_S = 0.002
#: The least time between two rounds, however short a publisher's grant: a publish near its
#: ``--max-hold-seconds`` is granted ever less time, and holding it cannot extend it anyway.
MIN_ROUND_S = 0.05
#: How soon a round comes again after a Hold that failed (the publisher may be back by then).
RETRY_HOLD_S = 1.0


def hold_period(settings: Settings) -> float:
    """Seconds between two rounds: a third of a lease (so one lost hold costs nothing), at most 5.

    Sooner when a publisher grants less: its publish may carry a lease of its own
    (``Publish.lease_seconds``), shorter than this side's ``--lease-seconds``; see :meth:`Holds._hold`.
    """
    return min(settings.lease_seconds / 3.0, 5.0)


@dataclass
class _Expected:
    addresses: tuple[str, ...]
    until: float  # time.monotonic(): stop holding then


class Holds:
    """Requests this (decode) sidecar expects to pull, and the task that holds them (see the module docs)."""

    def __init__(
        self, settings: Settings, peers: PeerDirectory, *, me: Callable[[], tuple[str, str, common_pb2.Rank | None]]
    ) -> None:
        self.settings = settings
        self.peers = peers
        self._me = me  # (engine id, instance id, rank once registered)
        self.expected: dict[str, _Expected] = {}
        #: Per expected request, the publishers' latest grants by address (what a pull may READ without a lookup).
        self.grants: dict[str, dict[str, Grant]] = {}
        self._task: asyncio.Task[None] | None = None
        self._fresh: dict[str, list[str]] = {}  # newly expected requests by address, not held yet
        self._fresh_task: asyncio.Task[None] | None = None  # sends them (see _hold_fresh)
        self._fresh_sent = -FRESH_HOLD_SPACING_S  # time.monotonic() the last of them left
        self._spacing = _Alarm()  # _hold_fresh waits out the spacing on it
        #: Per request whose first Hold has not been answered, by address: that answer (see the module docs).
        self._first: dict[str, dict[str, Due]] = {}
        #: Holds of newly expected requests sent (tests: how many went together).
        self.fresh_holds = 0
        self._next_round = math.inf  # time.monotonic() the next round is due (see _run)
        self._round_due = _Alarm()  # _run waits for the next round on it
        #: Per address, the last round's Hold while it is out: a publisher that does not answer
        #: (its host is gone) delays nobody else's Holds, and gets no second one meanwhile.
        self._round_out: dict[str, asyncio.Task[None]] = {}
        self._fresh_out: dict[str, asyncio.Task[None]] = {}  # per address, the fresh Hold while it is out

    def expect(self, request_id: str, addresses: list[str]) -> bool:
        """Hold ``request_id`` at ``addresses`` from now on; False when it was already expected."""
        new = request_id not in self.expected
        self.expected[request_id] = _Expected(tuple(addresses), time.monotonic() + self.settings.max_hold_seconds)
        loop = asyncio.get_running_loop()
        if new and request_id not in self._first:
            # The pull may start milliseconds from now: its grant must not wait for the next round.
            self._first[request_id] = {a: loop.create_future() for a in addresses}
            for address in addresses:
                self._fresh.setdefault(address, []).append(request_id)
            if self._fresh_task is None or self._fresh_task.done():
                self._fresh_task = loop.create_task(self._hold_fresh())
        if self._task is None or self._task.done():
            self._next_round = time.monotonic() + hold_period(self.settings)
            self._task = loop.create_task(self._run())
        return new

    async def _hold_fresh(self) -> None:
        """Hold the newly expected requests now, or FRESH_HOLD_SPACING_S after the last such Hold left
        (sooner when a pull waits for one of them); those expected meanwhile go in the next Holds (batched).

        A publisher gets one such Hold at a time: the requests expected there while one is out go
        when it ends (:meth:`_fresh_ended`), and one that does not answer delays no other publisher's.
        """
        while any(a not in self._fresh_out for a in self._fresh):
            wait = self._fresh_sent + FRESH_HOLD_SPACING_S - time.monotonic()
            if wait > 0:
                await self._spacing.sleep(wait)
            ready = [a for a in self._fresh if a not in self._fresh_out]
            if not ready:
                continue  # the Holds out ended none while the spacing was waited out
            self._fresh_sent = time.monotonic()
            self.fresh_holds += 1
            for address in ready:
                # A request whose pull started is still held once when that pull waits for the answer.
                rids = [r for r in self._fresh.pop(address) if r in self.expected or r in self._first]
                if rids:
                    self._send(self._fresh_out, address, rids, then=self._fresh_ended)

    def _fresh_ended(self, address: str) -> None:
        """A fresh Hold ended: the requests expected at its publisher meanwhile go now (spacing allowing)."""
        if address in self._fresh and (self._fresh_task is None or self._fresh_task.done()):
            self._fresh_task = asyncio.get_running_loop().create_task(self._hold_fresh())

    def _send(
        self, out: dict[str, asyncio.Task[None]], address: str, rids: list[str],
        then: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """Hold ``rids`` at ``address`` in a task of its own, in ``out`` while it runs; ``then(address)`` after."""
        task = out[address] = asyncio.get_running_loop().create_task(self._hold_all({address: rids}))

        def ended(done: asyncio.Task[None]) -> None:
            if out.get(address) is done:
                del out[address]
            if not done.cancelled() and done.exception() is not None:  # what _hold does not catch: a bug
                log.error("holding requests at a publisher failed", exc_info=done.exception(), extra={"peer": address})
            if then is not None:
                then(address)

        task.add_done_callback(ended)

    def discard(self, request_id: str) -> None:
        """Stop holding ``request_id`` (it was aborted)."""
        self.expected.pop(request_id, None)
        self.grants.pop(request_id, None)
        _settle_all(self._first.pop(request_id, {}))

    def drop_publishers(self, request_id: str, addresses: set[str]) -> None:
        """The publishers at ``addresses`` dropped ``request_id`` (their peer Abort): their grants no longer
        hold and it is no longer held there; a pull to come asks them (and fails). Publishers of other
        requests, and this request's other publishers, are not concerned."""
        e = self.expected.get(request_id)
        if e is not None:
            left = tuple(a for a in e.addresses if a not in addresses)
            if left:
                e.addresses = left
            else:
                del self.expected[request_id]
        grants = self.grants.get(request_id)
        if grants is not None:
            for a in addresses & grants.keys():
                del grants[a]
            if not grants:
                del self.grants[request_id]
        due = self._first.get(request_id)
        if due is not None:
            _settle_all({a: due.pop(a) for a in addresses & due.keys()})
            if not due:
                del self._first[request_id]
        for a in addresses:
            fresh = self._fresh.get(a)
            if fresh is not None and request_id in fresh:
                fresh.remove(request_id)
                if not fresh:
                    del self._fresh[a]

    def take(self, request_id: str) -> tuple[dict[str, Grant], dict[str, Due]]:
        """Stop holding ``request_id`` (its pull starts): its grants by publisher address, and the
        answers still due to its first Holds (addresses without a grant yet; see the module docs)."""
        self.expected.pop(request_id, None)
        grants = self.grants.pop(request_id, {})
        due = {a: f for a, f in self._first.get(request_id, {}).items() if a not in grants and not f.done()}
        if not due:
            self._first.pop(request_id, None)
        elif any(request_id in self._fresh.get(a, ()) for a in due):
            # Its Hold has not left: the next fresh Hold goes now if the spacing is being waited
            # out, or as soon as the one still out at that publisher ends (the pull looks the request
            # up if that takes GRANT_WAIT_S).
            self._fresh_sent = -FRESH_HOLD_SPACING_S
            self._spacing.wake()
        return grants, due

    def clear(self) -> None:
        """Stop holding everything (the worker is gone)."""
        self.expected.clear()
        self.grants.clear()
        self._fresh.clear()
        for due in self._first.values():
            _settle_all(due)
        self._first.clear()

    async def close(self) -> None:
        """Stop the holding tasks."""
        self.clear()
        tasks = (self._fresh_task, self._task, *self._round_out.values(), *self._fresh_out.values())
        for task in [t for t in tasks if t is not None]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        # A request is first held by _hold_fresh as it is expected; the rounds hold it again, every
        # hold_period unless a grant shorter than a lease of ours brings the next round forward.
        while self.expected:
            wait = self._next_round - time.monotonic()
            if wait > 0:
                await self._round_due.sleep(wait)
                continue  # the round is due now, or was brought forward: look again
            self._next_round = time.monotonic() + hold_period(self.settings)
            self._round()

    def _round(self) -> None:
        now = time.monotonic()
        for rid in [r for r, e in self.expected.items() if e.until <= now]:
            del self.expected[rid]
            self.grants.pop(rid, None)
            with log_context(request_id=rid):
                log.warning("stopped holding a request that was never pulled",
                            extra={"max_hold_seconds": self.settings.max_hold_seconds})  # fmt: skip
        by_address: dict[str, list[str]] = {}
        for rid, e in self.expected.items():
            for address in e.addresses:
                by_address.setdefault(address, []).append(rid)
        for address, rids in by_address.items():
            if address not in self._round_out:  # else its last round's Hold is still out
                self._send(self._round_out, address, rids)

    async def _hold_all(self, by_address: dict[str, list[str]]) -> None:
        # A Hold carries at most HOLD_BATCH ids (the publisher refuses more): larger sets go in several.
        chunks = [(a, rids[i : i + HOLD_BATCH]) for a, rids in by_address.items()
                  for i in range(0, len(rids), HOLD_BATCH)]  # fmt: skip
        await asyncio.gather(*(self._hold(a, rids) for a, rids in chunks))

    async def _hold(self, address: str, rids: list[str]) -> None:
        engine_id, instance_id, rank = self._me()
        req = peer_pb2.HoldRequest(request_ids=rids, engine_id=engine_id, instance_id=instance_id, rank=rank)
        try:
            await self.peers.session(address, budget=PEER_CALL_SECONDS)  # a publisher holds only for a known reader
            sent = time.monotonic()  # the publisher's promise runs from its answer, which comes later
            resp = await self.peers.call(
                address, "Hold", lambda s: s.Hold(req, timeout=PEER_CALL_SECONDS, metadata=self.peers.metadata)
            )
        except KvxferError as exc:  # the next round tries again; the lease may still cover the gap
            if exc.reason is Reason.NOT_HANDSHAKEN:
                self.peers.invalidate(address)  # the publisher forgot us (too many readers): handshake again
            log.warning("could not hold requests at a publisher", extra={"peer": address, "error": exc.message,
                        "requests": len(req.request_ids)})  # fmt: skip
            self._answered(address, rids, {})  # a pull waiting for it looks the request up instead
            self._hold_again_by(time.monotonic() + min(RETRY_HOLD_S, hold_period(self.settings)))
            return
        except BaseException:
            self._answered(address, rids, {})
            raise
        held = set(resp.held)
        granted: dict[str, Grant] = {}
        for g in resp.grants:
            if g.request_id in self.expected or g.request_id in self._first:
                if not math.isfinite(g.held_seconds) or g.held_seconds < 0:
                    # The publisher's input error: no promise to READ on (a pull looks the request up).
                    stale = self.grants.get(g.request_id)
                    if stale is not None and stale.pop(address, None) is not None and not stale:
                        del self.grants[g.request_id]
                    with log_context(request_id=g.request_id, peer=address):
                        log.warning("publisher granted a hold of no usable length; not reading on it",
                                    extra={"held_seconds": repr(g.held_seconds), "reason": Reason.PEER_INPUT.value,
                                           "field": "grants.held_seconds"})  # fmt: skip
                    continue
                blocks = {pg.name: ids_array(pg.block_ids) for pg in g.groups}
                granted[g.request_id] = Grant(sent + g.held_seconds, resp.instance_id, int(resp.epoch), blocks)
                if g.request_id in self.expected:
                    self.grants.setdefault(g.request_id, {})[address] = granted[g.request_id]
                    self._hold_again_by(sent + max(g.held_seconds / 3.0, MIN_ROUND_S))
        self._answered(address, rids, granted)
        for rid in req.request_ids:
            if rid not in held and rid in self.expected:
                # Released, expired, aborted, or another reader's: holding it further cannot help.
                del self.expected[rid]
                self.grants.pop(rid, None)
                with log_context(request_id=rid, peer=address):
                    log.info("publisher no longer holds an expected request; stopped holding it")

    def _hold_again_by(self, when: float) -> None:
        """Bring the next round forward to ``when`` (time.monotonic()) if it is due later.

        A third of what the publisher granted, as :func:`hold_period` is of a lease: a publish whose
        own lease is shorter than this side's rounds would expire between two of them.
        """
        if when < self._next_round:
            self._next_round = when
            self._round_due.wake()

    def _answered(self, address: str, rids: list[str], granted: dict[str, Grant]) -> None:
        """A Hold at ``address`` ended: what its requests' first Holds were due there (None: no grant)."""
        for rid in rids:
            due = self._first.get(rid)
            if due is None:
                continue
            fut = due.pop(address, None)
            if fut is not None and not fut.done():
                fut.set_result(granted.get(rid))
            if not due:
                del self._first[rid]


class _Alarm:
    """A sleep that can be cut short: :meth:`wake` ends the one in progress (nothing when none is)."""

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._fut = loop.create_future()
        timer = loop.call_later(seconds, _wake, self._fut)
        try:
            await self._fut
        finally:
            timer.cancel()
            self._fut = None

    def wake(self) -> None:
        _wake(self._fut)


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _settle_all(due: dict[str, Due]) -> None:
    """No grant will come for these (the request was aborted, or the worker is gone)."""
    for fut in due.values():
        if not fut.done():
            fut.set_result(None)
