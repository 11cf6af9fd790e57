"""The steps of one pull, in order: (1) sources, (2) handshakes and lookups, (3) descriptors, (4) READs.

(1) works out which remote ranks hold what this rank needs (its own layout alone), (2) handshakes
them (cached) and asks each for the published request (:mod:`kvxfer.server.lookups`), (3) checks
what they answer and builds descriptors with :mod:`kvxfer.topology` (:mod:`kvxfer.server.pull_descriptors`),
(4) READs from every rank at once over the data plane (:mod:`kvxfer.server.pull_reads`).
Each step is a call of its own and raises a typed error with a reason; a retry policy or another
step goes in between (:meth:`PullSteps.run`).

**Reading ahead.** When the worker names the publisher's block ids of every group (the vLLM
connector does, from ``kv_transfer_params``) and the publisher's handshake carried its region
tables, (3) and (4) do not wait for (2): the READs start with those ids and tables while the
lookups run, and the pull succeeds only once every lookup confirmed it. The lookup answering means
the publish was held from its publication until then, and it holds the blocks for
``--transfer-timeout-seconds`` more, so no block is reused under the READ; a publisher that
restarted or registered again since its handshake, or ids it did not publish, fail the pull and
its bytes are never reported as moved.

**Reading on a grant.** A request the decode side held while it waited (``Expect``, peer ``Hold``:
:mod:`kvxfer.server.holds`) comes with each publisher's grant: its block ids, and a time until
which it holds them, counted on this side's clock from when the Hold was sent. When every source
rank granted the request for longer than the pull may take, with the regions of the same
registration, and the worker's ids are among the granted ones, the pull READs at once and asks
nothing: no control round trip is on its critical path. A READ still running
:data:`GRANT_MARGIN_S` before the grants run out looks the request up then, which holds the
blocks longer; one that ends after what held them fails (its bytes unused).

**Reading ahead of the Hold's answer.** A pull that comes while its request's first Hold is still
out reads ahead as above, and that Hold's answer confirms the READs instead of a lookup: a grant
that covers the worker's ids, from the handshake's publisher registration, shows as a lookup's
answer would that the publish was held from its publication until then, and it promises the blocks
until its ``valid_until``, which the READs must not outlast. A rank whose grant does not come within
:data:`GRANT_WAIT_S`, or does not cover the pull, is looked up. What surrounds a pull (admission, its
task, the outcome's events, metrics and notices) is :mod:`kvxfer.server.puller`'s.

Each pull is counted by what confirmed its READs (``kvxfer_pulls_by_path_total{path}``): ``grant``
(one that had come before the pull: nothing was waited for), ``hold_answer`` (the answers of Holds
that were out), ``ahead`` (the lookups, as the READs ran), ``lookup`` (the lookups, before the READs),
``push`` (the publishers WRITE).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import (
    DeadlineError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvxferError,
    PeerUnavailableError,
    Reason,
)
from kvxfer.server.lookups import Fetched, Lookups, from_grant, from_handshakes
from kvxfer.server.outbox import Outbox
from kvxfer.server.peers import PeerDirectory, PeerSession
from kvxfer.server.pull_descriptors import descriptors, remote_lists
from kvxfer.server.pull_reads import PullReads
from kvxfer.server.push_steps import PushSteps
from kvxfer.server.registration import Registry
from kvxfer.server.state import Grant, PullEntry, Registration
from kvxfer.server.topologies import TopologyCache
from kvxfer.server.validation import not_published
from kvxfer.server.worker_gathers import WorkerGathers
from kvxfer.transport import Transport
from kvxfer.wire import local_pb2

__all__ = ["PullSteps"]

U64 = npt.NDArray[np.uint64]
#: A grant with less than this left is not read on (a lookup confirms instead): a READ needs time.
GRANT_MARGIN_S = 1.0
#: How long a pull that reads ahead waits for the answer of a Hold that was out when it came before it
#: looks the request up instead; an answer takes a round trip (~1 ms), so this long means a publisher in trouble.
GRANT_WAIT_S = 0.5
I64 = npt.NDArray[np.int64]


class PullSteps:
    """The steps of a pull (see the module docs); stateless between pulls apart from caches it reads."""

    def __init__(
        self, registry: Registry, data_plane: Transport, peers: PeerDirectory, outbox: Outbox,
        topologies: TopologyCache, on_plan: Callable[[str], None] = lambda _outcome: None,
        on_path: Callable[[str], None] = lambda _path: None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.peers = peers
        self.outbox = outbox
        self.topologies = topologies
        self.push = PushSteps(registry, peers)
        self.lookups = Lookups(registry, peers, outbox)
        #: READs handed to the worker as gathers (PullRequest.worker_gather).
        self.worker = WorkerGathers()
        self.reads = PullReads(data_plane, peers, self.worker)
        #: Told "used" when a pull reads on its Prepare's plan, "replanned" when it found the plan stale.
        self.on_plan = on_plan
        #: Told each pull's path once its READs are confirmed (see the module docs).
        self.on_path = on_path

    async def run(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64],
        sessions: dict[int, PeerSession],
    ) -> local_pb2.TransferStats:  # fmt: skip
        """Every step of one pull, in order; ``sessions`` collects the peers contacted (for cleanup on failure)."""
        ranks = self._plan_sources(entry, reg)
        if entry.push:
            self.on_path("push")
            return await self.push.run(entry, ranks, sessions, self.lookups.check_rank)
        named = all(name in remote_given for name in reg.groups)
        if entry.grants and named:
            granted = await self._read_granted(entry, reg, ranks, local_blocks, remote_given, sessions)
            if granted is not None:
                return granted
        if named:
            ahead = await self._read_ahead(entry, reg, ranks, local_blocks, remote_given, sessions)
            if ahead is not None:
                return ahead
        self.on_path("lookup")
        t_fetch = time.monotonic()
        published = await self.lookups.fetch_all(entry, ranks, sessions)
        fetch_seconds = time.monotonic() - t_fetch
        per_rank, warnings = descriptors(self.topologies, entry, reg, local_blocks, remote_given, published, sessions)
        moved = await self.reads.read_all(entry, reg, per_rank, published, sessions)
        return _done(entry, ranks, moved, warnings, fetch_seconds)

    # ------------------------------------------------------------------ 1. sources
    def _plan_sources(self, entry: PullEntry, reg: Registration) -> list[int]:
        """Which remote ranks hold what this rank needs (from the local layout alone)."""
        entry.stage = "planning sources"
        remote_tp = len(entry.addresses)
        needed: set[int] = set()
        for name, g in reg.groups.items():
            try:
                needed |= self.topologies.sources(name, g.layout, reg, remote_tp)
            except KvxferError as exc:
                raise FailedPreconditionError(
                    f"remote_addresses: {remote_tp} remote ranks do not fit group {name!r}: {exc.message}",
                    field="remote_addresses", reason=Reason.LAYOUT,
                ) from None  # fmt: skip
        if reg.rank.tp_rank == 0:
            # Remote ranks that no local rank reads (replicated heads or MLA latents) would hold their
            # blocks until the lease expires; local rank 0 tells them to free at once.
            everyone = self.topologies.read_by_all(reg, remote_tp)
            entry.unread = [entry.addresses[q] for q in range(remote_tp) if q not in everyone]
        return sorted(needed)

    # ------------------------------------------------------------------ reading on a grant
    async def _read_granted(
        self, entry: PullEntry, reg: Registration, ranks: list[int], local_blocks: dict[str, I64],
        remote_given: dict[str, I64], sessions: dict[int, PeerSession],
    ) -> local_pb2.TransferStats | None:  # fmt: skip
        """READ on the publishers' grants, without a lookup (None: some rank's grant does not cover the pull)."""
        used: dict[int, PeerSession] = {}
        for q in ranks:
            address = entry.addresses[q]
            grant = entry.grants.get(address)
            if grant is None or grant.valid_until < time.monotonic() + GRANT_MARGIN_S:
                return None  # no promise, or too little of it left: confirm with a lookup
            session = await self._readable_session(entry, reg, q)
            if session is None or not _covers(grant, session, remote_given):
                return None
            used[q] = session
        guess = from_handshakes(used, remote_given, reg)
        sessions.update(used)
        per_rank, warnings = self._planned(entry, reg, local_blocks, remote_given, guess, used)
        self.on_path("grant")
        for q in ranks:
            entry.asked.append(entry.addresses[q])
            entry.contacted.append(entry.addresses[q])  # they are told DONE or FAILED, as after a lookup
        promised = min(entry.grants[entry.addresses[q]].valid_until for q in ranks)
        moved = await self._read_while_promised(entry, reg, ranks, per_rank, guess, sessions, promised)
        return _done(entry, ranks, moved, warnings, 0.0)

    async def _read_while_promised(
        self, entry: PullEntry, reg: Registration, ranks: list[int], per_rank: dict[int, list[tuple[U64, U64]]],
        guess: dict[int, Fetched], sessions: dict[int, PeerSession], promised: float,
    ) -> tuple[int, int, float]:  # fmt: skip
        """READ on grants that hold the blocks until ``promised`` (time.monotonic()).

        The READs must end while the blocks are held, or the pull fails (its bytes unused). One still
        running :data:`GRANT_MARGIN_S` before the grants run out (a large READ, a short lease) looks
        the request up, which holds the blocks for the publisher's ``--transfer-timeout-seconds``
        more, rather than being cut off where the grant ends.
        """
        loop = asyncio.get_running_loop()
        renewal: asyncio.Future[dict[int, Fetched]] | None = None
        read_from = {q: sessions[q] for q in ranks}

        def renew() -> None:
            nonlocal renewal
            renewal = asyncio.ensure_future(self.lookups.fetch_all(entry, ranks, sessions, stage=False))

        timer = loop.call_later(max(promised - GRANT_MARGIN_S - time.monotonic(), 0.0), renew)
        try:
            moved = await self.reads.read_all(entry, reg, per_rank, guess, sessions)
        except BaseException:
            _drop(renewal)
            raise
        finally:
            timer.cancel()
        if time.monotonic() <= promised:
            _drop(renewal)  # the grants held the blocks for the whole READ
            return moved
        if renewal is None:
            raise _outlasted(entry)
        fetched = await renewal  # answered only while the publish is held: then it never lapsed
        if any(sessions[q] is not s for q, s in read_from.items()):
            # The publisher registered again since the handshake whose regions were read.
            raise PeerUnavailableError(f"the publishers of {entry.request_id!r} changed while it was read",
                                       field="remote_addresses", reason=Reason.PEER_CHANGED)  # fmt: skip
        if time.monotonic() > min(f.valid_until for f in fetched.values()):
            raise _outlasted(entry)
        return moved

    # ------------------------------------------------------------------ reading ahead of the lookups
    async def _read_ahead(
        self, entry: PullEntry, reg: Registration, ranks: list[int], local_blocks: dict[str, I64],
        remote_given: dict[str, I64], sessions: dict[int, PeerSession],
    ) -> local_pb2.TransferStats | None:  # fmt: skip
        """READ with the given ids and the handshakes' regions while the lookups run (None: cannot, wait for them)."""
        entry.stage = "contacting " + ", ".join(entry.addresses[q] for q in ranks)
        used = await self._readable_sessions(entry, reg, ranks)
        if isinstance(used, int):
            return None
        guess = from_handshakes(used, remote_given, reg)
        sessions.update(used)
        per_rank, warnings = self._planned(entry, reg, local_blocks, remote_given, guess, used)
        published, moved, fetch_seconds = await self._read_while_looking_up(entry, reg, ranks, per_rank, guess,
                                                                            used, sessions, remote_given)  # fmt: skip
        if not self._confirm(entry, reg, remote_given, used, published, sessions):
            # The publisher restarted or registered again since the handshake whose regions were
            # read: those bytes are not used; READ again with what its lookup answered.
            per_rank, warnings = descriptors(
                self.topologies, entry, reg, local_blocks, remote_given, published, sessions
            )
            moved = await self.reads.read_all(entry, reg, per_rank, published, sessions)
        assert moved is not None
        return _done(entry, ranks, moved, warnings, fetch_seconds)

    # ------------------------------------------------------------------ planning ahead (Prepare)
    async def prepare(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64]
    ) -> tuple[dict[int, PeerSession], dict[int, list[tuple[U64, U64]]], list[str]] | str:
        """Plan a pull before it comes (kvxfer.server.prepared): (sessions, descriptors per rank, warnings).

        What a pull that reads without waiting for lookups (on a grant, or ahead of them) would plan,
        from the publishers' handshakes. A string: why it cannot be planned ahead (the Pull plans then).
        Bad input raises as the Pull would.
        """
        if entry.push:
            return "push: the publishers WRITE, nothing is read"
        missing = [name for name in reg.groups if name not in remote_given]
        if missing:
            return f"remote_blocks: no publisher block ids for group {missing[0]!r} (the Pull looks them up)"
        ranks = self._plan_sources(entry, reg)
        used = await self._readable_sessions(entry, reg, ranks)
        if isinstance(used, int):
            q = used
            return f"remote_addresses[{q}]: the handshake with {entry.addresses[q]} carries no regions to plan with"
        guess = from_handshakes(used, remote_given, reg)
        per_rank, warnings = descriptors(self.topologies, entry, reg, local_blocks, remote_given, guess, used)
        return used, per_rank, warnings

    def _planned(
        self, entry: PullEntry, reg: Registration, local_blocks: dict[str, I64], remote_given: dict[str, I64],
        guess: dict[int, Fetched], used: dict[int, PeerSession],
    ) -> tuple[dict[int, list[tuple[U64, U64]]], list[str]]:  # fmt: skip
        """The descriptors of a pull read on the handshakes' regions: its Prepare's, when they still hold."""
        plan, entry.prepared = entry.prepared, None
        if plan is not None:
            if plan.fits(reg, used):
                self.on_plan("used")
                return dict(plan.per_rank), list(plan.warnings)
            self.on_plan("replanned")  # a publisher or this worker registered again since
        return descriptors(self.topologies, entry, reg, local_blocks, remote_given, guess, used)

    async def _readable_sessions(
        self, entry: PullEntry, reg: Registration, ranks: list[int]
    ) -> dict[int, PeerSession] | int:
        """Every rank's readable handshake (see :meth:`_readable_session`), or the first rank without one."""
        used: dict[int, PeerSession] = {}
        for q in ranks:
            session = await self._readable_session(entry, reg, q)
            if session is None:
                return q
            used[q] = session
        return used

    async def _readable_session(self, entry: PullEntry, reg: Registration, q: int) -> PeerSession | None:
        """Rank ``q``'s handshake (cached), when it can be read from without a lookup's answer (else None)."""
        remaining = max(entry.deadline - time.monotonic(), 0.001)
        session = await self.peers.session(entry.addresses[q], budget=remaining)
        try:
            self.lookups.check_rank(entry, q, session)
        except FailedPreconditionError:
            return None  # the careful path asks again (the handshake may predate a re-registration)
        if any(name not in session.identity.regions for name in reg.groups):
            return None  # a peer that does not send its regions: wait for its lookup
        return session

    async def _read_while_looking_up(
        self, entry: PullEntry, reg: Registration, ranks: list[int], per_rank: dict[int, list[tuple[U64, U64]]],
        guess: dict[int, Fetched], used: dict[int, PeerSession], sessions: dict[int, PeerSession],
        remote_given: dict[str, I64],
    ) -> tuple[dict[int, Fetched], tuple[int, int, float] | None, float]:  # fmt: skip
        """(lookup answers, what the READs moved or None when they must be redone, lookup seconds).

        The answers of the first Holds still out confirm their ranks instead of lookups (see the module docs).
        """
        t_fetch = time.monotonic()
        fetch_seconds = 0.0
        promised_until = math.inf  # what confirmed (grants, lookups): the READs must end before the earliest runs out

        async def confirm() -> dict[int, Fetched]:
            nonlocal fetch_seconds, promised_until
            try:
                granted = await self._hold_answers(entry, reg, ranks, used, remote_given)
                if granted:
                    promised_until = min(g.valid_until for _, g in granted.values())
                rest = [q for q in ranks if q not in granted]
                fetched = await self.lookups.fetch_all(entry, rest, sessions, stage=False) if rest else {}
                promised_until = min([promised_until, *(f.valid_until for f in fetched.values())])
                self.on_path("ahead" if rest else "hold_answer")
                return {**{q: f for q, (f, _) in granted.items()}, **fetched}
            finally:
                fetch_seconds = time.monotonic() - t_fetch

        lookups = asyncio.ensure_future(confirm())
        reads = asyncio.ensure_future(self.reads.read_all(entry, reg, per_rank, guess, sessions, confirmed=False))
        moved: tuple[int, int, float] | None
        try:
            await asyncio.wait((lookups, reads), return_when=asyncio.FIRST_EXCEPTION)
            if lookups.done() and lookups.exception() is not None:
                raise lookups.exception()  # type: ignore[misc]  # not published, refused...: stop reading
            published = await lookups
            try:
                moved = await reads
            except KvxferError:
                if all(sessions[q] is s for q, s in used.items()):
                    raise
                moved = None  # read from a registration the publisher has replaced since: read again
            if time.monotonic() > promised_until:
                raise _outlasted(entry)
        finally:
            for task in (lookups, reads):
                if not task.done():
                    task.cancel()
            await asyncio.gather(lookups, reads, return_exceptions=True)
        return published, moved, fetch_seconds

    async def _hold_answers(
        self, entry: PullEntry, reg: Registration, ranks: list[int], used: dict[int, PeerSession],
        remote_given: dict[str, I64],
    ) -> dict[int, tuple[Fetched, Grant]]:  # fmt: skip
        """The ranks the pull's grants confirm as a lookup's answer would, each with its grant: those that
        came before it, and the answers of its first Holds (waited for up to GRANT_WAIT_S). Those ranks are
        contacted as after a lookup."""
        due, entry.grants_due = entry.grants_due, {}
        waited = [due[a] for a in {entry.addresses[q] for q in ranks} if a in due and a not in entry.grants]
        if not waited and not entry.grants:
            return {}
        if waited:
            await asyncio.wait(waited, timeout=max(min(entry.deadline - time.monotonic(), GRANT_WAIT_S), 0.0))
        out: dict[int, tuple[Fetched, Grant]] = {}
        for q in ranks:
            address = entry.addresses[q]
            grant, fut = entry.grants.get(address), due.get(address)
            if grant is None and fut is not None and fut.done() and not fut.cancelled():
                grant = fut.result()
            if grant is None or grant.valid_until < time.monotonic() + GRANT_MARGIN_S:
                continue
            if not _covers(grant, used[q], remote_given):
                continue  # other ids, or another registration: the lookup decides
            out[q] = (from_grant(grant, used[q], reg), grant)
            entry.asked.append(address)
            entry.contacted.append(address)  # told DONE or FAILED, as after a lookup
        return out

    def _confirm(
        self, entry: PullEntry, reg: Registration, remote_given: dict[str, I64], used: dict[int, PeerSession],
        published: dict[int, Fetched], sessions: dict[int, PeerSession],
    ) -> bool:  # fmt: skip
        """Whether the lookups confirm what was read ahead: every id published (else the pull fails), and
        the same publisher registrations (False: the regions read are stale)."""
        try:
            for name in reg.groups:
                remote_lists(entry, name, remote_given.get(name), published)
        except InvalidArgumentError:
            entry.contacted.clear()  # the caller's mistake: the publishes stay as they were
            raise
        return all(sessions[q] is s for q, s in used.items())


def _covers(grant: Grant, session: PeerSession, remote_given: dict[str, I64]) -> bool:
    """The grant is from the handshake's publisher registration and names every id the worker gave."""
    them = session.identity
    return (them.instance_id, them.epoch) == (grant.instance_id, grant.epoch) and all(
        name in grant.blocks and not not_published(ids, grant.blocks[name]) for name, ids in remote_given.items()
    )


def _drop(task: asyncio.Future[Any] | None) -> None:
    """Cancel a lookup no one needs any more, its outcome retrieved (it may have failed already)."""
    if task is None:
        return
    if task.done():
        if not task.cancelled():
            task.exception()
    else:
        task.cancel()


def _outlasted(entry: PullEntry) -> DeadlineError:
    return DeadlineError(
        f"the READs of {entry.request_id!r} outlasted the time a publisher held the blocks for them (a grant, a "
        "lookup): their bytes are not used",
        field="timeout_seconds",
    )


def _done(
    entry: PullEntry, ranks: list[int], moved: tuple[int, int, float], warnings: list[str], fetch_seconds: float
) -> local_pb2.TransferStats:
    """The stats of a finished pull: ``moved`` is (bytes, descriptors, seconds of data movement)."""
    entry.stage = "done"
    total_bytes, total_desc, data_seconds = moved
    return local_pb2.TransferStats(
        bytes=total_bytes, descriptors=total_desc, duration_seconds=time.monotonic() - entry.started,
        data_seconds=data_seconds, remote_ranks=ranks, warnings=sorted(set(warnings)), fetch_seconds=fetch_seconds,
    )  # fmt: skip
