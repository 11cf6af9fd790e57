"""The blocking facade of :class:`~kvxfer.client.aio.AsyncClient`: one client on a private event-loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import uvloop

from kvxfer.client.aio import AsyncClient
from kvxfer.client.types import CompletionEvent, _check_timeout, normalize_target

__all__ = ["Client"]

P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Client, P], T]:
    """``method`` of :class:`AsyncClient`, run on the client's loop and waited for."""

    def run(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.call(method(self.aio, *args, **kwargs))

    run.__name__ = method.__name__
    run.__doc__ = f"Blocking :meth:`AsyncClient.{method.__name__}`."
    return run


class Client:
    """Blocking facade of an :class:`AsyncClient` that runs on a private event-loop thread.

    Usable from any thread (and from inside another event loop, which it never blocks on its own
    loop's behalf). :attr:`aio` is the async client; :meth:`submit` and :meth:`call` run any of its
    coroutines. Close it (or use ``with``) to stop the thread. ``fast`` as for :class:`AsyncClient`.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        fast: bool = True,
    ) -> None:
        self.target = normalize_target(target)
        self.timeout = _check_timeout(timeout)
        # uvloop: the facade's round trips are loop-bound; measured ~10% less CPU per call.
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvxfer-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:
            # grpc.aio binds a channel to the loop that creates it.
            return AsyncClient(target, token=token, timeout=timeout, credentials=credentials,
                               max_message_bytes=max_message_bytes, fast=fast)  # fmt: skip

        self.aio = self.call(make())

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Run ``coro`` on the client's loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for its result (calls bound themselves by their deadline)."""
        return self.submit(coro).result(timeout)

    register_caches = _blocking(AsyncClient.register_caches)
    publish = _blocking(AsyncClient.publish)
    pull = _blocking(AsyncClient.pull)
    pull_batch = _blocking(AsyncClient.pull_batch)
    release = _blocking(AsyncClient.release)
    abort = _blocking(AsyncClient.abort)
    drop_remote = _blocking(AsyncClient.drop_remote)
    expect = _blocking(AsyncClient.expect)
    drain = _blocking(AsyncClient.drain)
    status = _blocking(AsyncClient.status)
    wait_ready = _blocking(AsyncClient.wait_ready)

    def watch_completions(self, *, replay: bool = False, after: int = 0) -> Iterator[CompletionEvent]:
        """Blocking :meth:`AsyncClient.watch_completions`; cancel by closing the iterator."""
        stream = self.aio.watch_completions(replay=replay, after=after)

        async def following() -> CompletionEvent:
            return await anext(stream)

        try:
            while True:
                try:
                    yield self.call(following())
                except StopAsyncIteration:
                    return
        finally:
            with contextlib.suppress(Exception):
                self.call(stream.aclose(), timeout=5)

    def close(self) -> None:
        """Close the channel and stop the loop thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):  # best effort: the channel may be broken already
            self.call(self.aio.close(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
