"""NIXL data plane (UCX by default; the backend list is configurable).

Descriptor arrays go to NIXL as numpy (N, 3) arrays in one call, never through a Python loop.
Prepared descriptor lists (``prep_xfer_dlist`` + ``make_prepped_xfer``) pay when the same fixed
pages are addressed by index again and again; kvxfer's descriptors are coalesced per request
(few, of varying length), so each transfer builds its list directly with ``initialize_xfer``.

The agent itself, with its UCX settings for GPU memory, is made in :mod:`kvxfer.transport.nixl_agent`.

DRAM on one host: NIXL's UCX backend copies a READ or WRITE between two processes' DRAM inside the
post itself (cross-memory attach), with the GIL released. Posted from the event loop, a large
transfer would hold up every other call of the sidecar for its whole copy (about 15 ms for 64 MiB
on a lent H200's host), so a DRAM transfer of at least ``TransportConfig.nixl_thread_post_bytes``
is posted from a thread of the transport's own, the agent then running in NIXL's
``NIXL_THREAD_SYNC_RW`` mode (data-path calls may come from two threads). Smaller ones stay on the
loop: handing one to a thread and back costs the loop more than its copy (figures:
docs/notes/gpu.md, "Stop 35").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib
import logging
import time
from typing import Any

import numpy as np

from kvxfer.topology import RegionTable
from kvxfer.transport.base import (
    U64,
    MemType,
    Notification,
    Op,
    Registration,
    TransferResult,
    Transport,
    TransportConfig,
    check_descriptors,
)
from kvxfer.transport.errors import (
    BackendUnavailableError,
    PeerUnknownError,
    RegistrationError,
    TransferFailedError,
    TransferTimeoutError,
    TransportError,
    UnfencedOp,
    describe_span,
)
from kvxfer.transport.nixl_agent import UCX_DEFAULTS, _make_agent, ucx_engine_config
from kvxfer.transport.registry import register_transport

__all__ = ["UCX_DEFAULTS", "NixlTransport", "ucx_engine_config"]

log = logging.getLogger(__name__)


@register_transport("nixl")
class NixlTransport(Transport):
    """A NIXL agent."""

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        try:
            self._agent, self._threaded = _make_agent(agent_name, self.config)
        except BackendUnavailableError:
            raise
        except Exception as exc:  # the binding raises its own exception types
            raise BackendUnavailableError(
                f"could not start agent {agent_name!r} with backends {list(self.config.nixl_backends)}",
                backend="nixl",
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        missing = [b for b in self.config.nixl_backends if b not in self._agent.backends]
        if missing:
            raise BackendUnavailableError(
                f"backend plugins {missing} are not available; plugins found: {self._agent.get_plugin_list()}",
                backend="nixl",
            )
        self._peers: set[str] = set()
        self._retired: set[str] = set()  # removed peers NIXL keeps until their operations ended
        self._live: dict[str, list[Any]] = {}  # peer -> handles of operations not yet released
        #: (peer, handle, what its error carries) reported failed before they ended.
        self._unfenced: list[tuple[str, Any, UnfencedOp]] = []
        self._poster: concurrent.futures.ThreadPoolExecutor | None = None  # started at its first post
        #: Transfers posted from the poster thread so far (tests, bench).
        self.thread_posts = 0

    @classmethod
    def library_loggers(cls) -> tuple[str, ...]:
        # Importing NIXL installs its plain-text handler (on stdout) for the "nixl" logger.
        with contextlib.suppress(ImportError):
            importlib.import_module("nixl")
        return ("nixl",)

    # ------------------------------------------------------------------ memory
    def register(self, table: RegionTable, mem_type: MemType = "DRAM") -> Registration:
        descs = np.stack([table.base, table.size, table.device], axis=1).astype(np.uint64)
        try:
            handle = self._agent.register_memory(descs, mem_type)
        except Exception as exc:
            raise RegistrationError(
                f"register_memory of {describe_span(descs)} as {mem_type} failed",
                backend="nixl",
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        self._track(table)
        return Registration(table, mem_type, handle)

    def deregister(self, registration: Registration) -> None:
        # A copy on the poster thread may be writing into this memory, which the caller unmaps next
        # (and may map again at the same address): it ends first, as a copy on the loop always had.
        self._drain_posts()
        try:
            self._agent.deregister_memory(registration.handle)
        except Exception as exc:
            raise RegistrationError("deregister_memory failed", backend="nixl", detail=str(exc)) from None
        self._untrack(registration.table)

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        self._reap()
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as first:
            # A restarted peer comes back under its old name with new metadata: replace it. Its name is
            # matched as the metadata's whole agent field, length included: a peer whose name is only
            # part of it (``dec-1`` in ``dec-10``'s) is another agent and stays.
            known = [p for p in self._peers | self._retired if _agent_field(p) in metadata]
            for p in known:
                self._forget(p)  # its operations still in flight can no longer be watched (see _forget)
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception:
                raise TransferFailedError(
                    "could not load the peer's metadata", backend="nixl", detail=f"{type(first).__name__}: {first}"
                ) from None
        peer = name.decode() if isinstance(name, bytes) else str(name)
        if (peer in self._peers or peer in self._retired) and not self._live.get(peer):
            # NIXL merges new metadata into a known agent's, so memory the peer has deregistered
            # since stays addressable: drop what we had and load the new metadata alone. (Not while
            # operations on it are in flight: removing the agent would lose sight of them.)
            self._agent.remove_remote_agent(peer)
            self._agent.add_remote_agent(metadata)
        self._retired.discard(peer)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget a peer. While operations on it are in flight (or failed unfenced), NIXL keeps its agent:
        removing it makes their handles unknown to NIXL (``NIXL_ERR_NOT_FOUND``) while UCX still lands
        their bytes, so it is removed once the last of them ended (see :meth:`_reap`)."""
        self._peers.discard(peer)
        if self._live.get(peer):
            self._retired.add(peer)
        else:
            self._forget(peer)

    def _forget(self, peer: str) -> None:
        """Remove the peer's agent from NIXL now; operations on it still in flight are lost from sight."""
        self._peers.discard(peer)
        self._retired.discard(peer)
        lost = self._live.pop(peer, [])
        for _, handle, unfenced in self._unfenced:
            if any(handle is h for h in lost):
                unfenced.watched = False  # lost from sight: no one can say it ended
        self._unfenced = [u for u in self._unfenced if u[2].watched]
        with contextlib.suppress(Exception):  # forgetting an unknown peer is not an error
            self._agent.remove_remote_agent(peer)

    def unfenced_live(self) -> int:
        self._reap()
        return len(self._unfenced)

    def _reap(self) -> None:
        """Release the handles of unfenced operations that have ended; forget removed peers left without any."""
        if self._agent is None:
            return
        still = []
        for peer, handle, unfenced in self._unfenced:
            state = _state(self._agent, handle)
            if state == "ended":
                self._release(peer, handle)
                unfenced.ended = True
            elif state == "live":
                still.append((peer, handle, unfenced))
            else:  # NIXL no longer knows it (its peer was replaced): nothing left to watch or release
                log.warning("nixl: an unfenced operation of peer %r can no longer be watched", peer)
                unfenced.watched = False
                self._drop(peer, handle)
        self._unfenced = still
        for peer in [p for p in self._retired if not self._live.get(p)]:
            self._forget(peer)

    def _release(self, peer: str, handle: Any) -> None:
        """Release an ended operation's handle (never a live one: releasing does not stop UCX's copy)."""
        self._drop(peer, handle)
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(handle)

    def _drop(self, peer: str, handle: Any) -> None:
        live = [h for h in self._live.get(peer, []) if h is not handle]
        if live:
            self._live[peer] = live
        else:
            self._live.pop(peer, None)

    # ------------------------------------------------------------------ transfers
    async def transfer(
        self,
        op: Op,
        local: U64,
        remote: U64,
        peer: str,
        *,
        timeout: float,
        notify: bytes | None = None,
        mem_type: MemType = "DRAM",
        remote_mem_type: MemType = "DRAM",
    ) -> TransferResult:
        if self._unfenced:
            self._reap()
        if peer not in self._peers:
            raise PeerUnknownError("peer was never added (or was removed)", backend="nixl", peer=peer)
        local, remote = check_descriptors(local, remote)
        agent = self._agent
        start = time.monotonic()
        try:
            ld = agent.get_xfer_descs(local, mem_type)
            rd = agent.get_xfer_descs(remote, remote_mem_type)
            handle = agent.initialize_xfer(op, ld, rd, peer, notify or b"")
        except Exception as exc:
            raise TransferFailedError(
                f"could not prepare {self._describe(op, local, remote)}",
                backend="nixl",
                peer=peer,
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        self._live.setdefault(peer, []).append(handle)
        nbytes = int(local[:, 1].sum())
        threaded = self._posts_on_thread(nbytes, mem_type, remote_mem_type)
        failure: TransportError | None = None
        cancelled = False
        try:
            if threaded:
                state = await _posted(self._submit_post(handle))
            else:
                state = agent.transfer(handle)
            delay = self.config.poll_min_s
            deadline = start + timeout
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferTimeoutError(
                        f"{self._describe(op, local, remote)} did not complete within {timeout:.3f}s",
                        backend="nixl",
                        peer=peer,
                    )
                if peer not in self._peers:
                    raise TransferFailedError(
                        f"{self._describe(op, local, remote)}: the peer was removed while it was in flight",
                        backend="nixl",
                        peer=peer,
                    )
                # Small transfers finish in microseconds, large ones should not spin a core.
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.poll_max_s)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailedError(
                    f"{self._describe(op, local, remote)} ended in state {state}",
                    backend="nixl",
                    peer=peer,
                )
        except (TransferTimeoutError, TransferFailedError) as exc:
            failure = exc
        except asyncio.CancelledError:
            cancelled = True
        except Exception as exc:  # e.g. nixlRemoteDisconnectError when the peer died
            failure = TransferFailedError(
                f"{self._describe(op, local, remote)} failed after {time.monotonic() - start:.3f}s",
                backend="nixl",
                peer=peer,
                detail=f"{type(exc).__name__}: {exc}",
            )
        if failure is None and not cancelled:
            self._release(peer, handle)
            return TransferResult(nbytes, int(local.shape[0]), time.monotonic() - start)
        # The fence: releasing a handle in flight does not stop UCX from landing its bytes later (nor
        # does removing the peer), so the error waits until NIXL says the operation ended.
        ended, cancel_came = await _fence(agent, handle, self.config)
        unfenced = UnfencedOp(op, peer)
        if ended:
            self._release(peer, handle)
        else:
            self._unfenced.append((peer, handle, unfenced))
        self._end_failed(op, peer, failure, cancelled=cancelled or cancel_came, ended=ended,
                         in_flight="its operation was", unfenced=unfenced)  # fmt: skip

    def _posts_on_thread(self, nbytes: int, mem_type: MemType, remote_mem_type: MemType) -> bool:
        """Whether this transfer is posted from the poster thread (see the module docs)."""
        least = self.config.nixl_thread_post_bytes
        return self._threaded and 0 < least <= nbytes and mem_type == "DRAM" and remote_mem_type == "DRAM"

    def _submit_post(self, handle: Any) -> concurrent.futures.Future[str]:
        self.thread_posts += 1
        return self._poster_thread().submit(self._agent.transfer, handle)

    def _drain_posts(self) -> None:
        """Return once every post handed to the poster thread so far has ended."""
        if self._poster is not None:
            self._poster.submit(int).result()  # one thread: it runs after every earlier post

    def _poster_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._poster is None:
            # One thread: large copies go one after another, as they did on the loop, but beside it.
            self._poster = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer-nixl-post")
        return self._poster

    def poll_notifications(self) -> list[Notification]:
        notifs = self._agent.get_new_notifs()
        return [
            Notification(peer.decode() if isinstance(peer, bytes) else str(peer), bytes(msg))
            for peer, msgs in notifs.items()
            for msg in msgs
        ]

    def close(self) -> None:
        if self._poster is not None:
            self._poster.shutdown(wait=True)  # a post in progress ends before the agent goes
            self._poster = None
        for peer in list(self._peers | self._retired):
            self._forget(peer)
        for _, _, unfenced in self._unfenced:
            unfenced.watched = False
        self._unfenced = []
        self._agent = None


def _agent_field(name: str) -> bytes:
    """How NIXL's serialized metadata carries the agent's name: ``|Agent``, its length (8 bytes, little-endian), it."""
    raw = name.encode()
    return b"|Agent" + len(raw).to_bytes(8, "little") + raw + b"|"


def _state(agent: Any, handle: Any) -> str:
    """``ended`` when NIXL says the handle's operation ended (done, or failed: UCX no longer touches its
    memory), ``live`` while in progress, ``lost`` when NIXL no longer knows the handle
    (``NIXL_ERR_NOT_FOUND``: the peer's agent was removed under it, while UCX still lands its bytes)."""
    try:
        return "live" if agent.check_xfer_state(handle) == "PROC" else "ended"
    except Exception as exc:
        return "lost" if isinstance(exc, _not_found_error()) else "ended"  # e.g. nixlRemoteDisconnectError


class _AbsentNixlError(Exception):
    """Stands for an error class this NIXL build does not have."""


@functools.cache
def _not_found_error() -> type[BaseException]:
    """NIXL's ``nixlNotFoundError`` (NIXL_ERR_NOT_FOUND), by class rather than by its name or message."""
    try:
        error: type[BaseException] = importlib.import_module("nixl._bindings").nixlNotFoundError
    except (ImportError, AttributeError):
        return _AbsentNixlError
    return error


async def _fence(agent: Any, handle: Any, config: TransportConfig) -> tuple[bool, bool]:
    """Wait until the handle's operation ended, at most ``config.fence_budget_s``.

    Returns (it ended, a cancel came meanwhile). A cancel does not cut the wait short: the caller
    re-raises it once the wait is over (no byte may land after a cancelled READ returned)."""
    deadline = time.monotonic() + config.fence_budget_s
    delay = config.poll_min_s
    cancelled = False
    while (state := _state(agent, handle)) != "ended":
        if state == "lost" or time.monotonic() >= deadline:
            return False, cancelled
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            cancelled = True
        delay = min(delay * 2, config.poll_max_s)
    return True, cancelled


async def _posted(post: concurrent.futures.Future[str]) -> str:
    """The state a post on the poster thread returned (or its error).

    A cancel that comes while it copies is raised only once the copy has ended: the copy cannot be
    stopped midway, and no byte may land after the transfer's caller has heard it ended (a worker
    frees the blocks of an aborted pull). Posted on the loop, a copy could not be interrupted either.
    """
    done = asyncio.wrap_future(post)
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True  # from outside (``done`` is shielded): wait for the copy, then raise it
        except Exception:
            break  # the post's own error, raised below
    if cancelled:
        raise asyncio.CancelledError
    return done.result()
