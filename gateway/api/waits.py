"""Answers held until the rollout queue changes (long polling).

A claim that finds nothing queued, and a list of rollouts some of which are still queued or running, may
be held up to ``wait_s`` seconds: a runner starts a rollout as soon as it is enqueued and a trainer sees its
groups end when they end, instead of at their next poll, and an idle runner costs one request per hold
instead of one per poll.

This gateway's own changes wake the held answers at once: tasks enqueued, rollouts completed, failed or
released (``QueueChanges.bump``, called from any thread by the routes that make them). Changes made through
another gateway on the same store (replicas on PostgreSQL) and leases that expire are seen when a held
answer looks again, every ``RECHECK_S``, no later than the poll it replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

T = TypeVar("T")

RECHECK_S = 0.5
"""How often a held answer looks at the store again when nothing on this gateway woke it."""
MAX_WAIT_S = 30.0
"""The longest hold a request may ask for (a client's read timeout must be longer)."""


class QueueChanges:
    """A version of the rollout queue, raised by ``bump`` (any thread); ``wait`` until it passes a seen one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.version = 0
        self._loop = loop
        self._waiters: set[asyncio.Future[None]] = set()

    def bump(self) -> None:
        """The queue changed: wake every held answer. Safe from the request threads and from the loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed (the gateway stopping): nobody waits
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.version += 1
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def wait(self, seen: int, timeout: float) -> None:
        """Until the version is no longer ``seen`` or ``timeout`` seconds pass."""
        if self.version != seen or timeout <= 0:
            return
        f: asyncio.Future[None] = self._loop.create_future()
        self._waiters.add(f)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f, timeout)
        finally:
            self._waiters.discard(f)


async def held(fetch: Callable[[], Awaitable[T]], ready: Callable[[T], bool], changes: QueueChanges,
               wait_s: float) -> T:
    """``await fetch()`` until ``ready`` holds of its answer or ``wait_s`` seconds pass (then the last
    answer): it fetches again when this gateway's queue changes and every ``RECHECK_S`` in any case."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        seen = changes.version  # before fetching: a change during the fetch wakes the wait below at once
        out = await fetch()
        left = deadline - loop.time()
        if left <= 0 or ready(out):
            return out
        await changes.wait(seen, min(left, RECHECK_S))


async def get_changes(request: Request) -> QueueChanges:
    """The app's ``QueueChanges``, made on first use on the app's loop (``async``: it runs on the loop)."""
    state = request.app.state
    changes = getattr(state, "queue_changes", None)
    if changes is None:
        changes = state.queue_changes = QueueChanges(asyncio.get_running_loop())
    return changes


ChangesDep = Annotated[QueueChanges, Depends(get_changes)]
