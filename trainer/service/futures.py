"""The API's futures: every training and sampling request is answered at once with a ``request_id``; its
work runs as a task owned by the service (a client that disconnects does not cancel it) and the client
polls ``/api/v1/retrieve_future`` until the result is there. A poll waits up to ``poll_wait`` seconds for
the task and then answers ``try_again``.

Request ids are random, and each future records its owner (the run whose key may read its result, or None:
the admin key only), so one run's key can neither guess nor read another run's results."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any


class UserFault(Exception):
    """A request that cannot be done as asked: its future fails with category ``user`` and this message."""


@dataclass(slots=True)
class Pending:
    task: asyncio.Task[Any]
    kind: str
    """``forward_backward``, ``sample`` (answered as protobuf when asked), or any other (JSON)."""
    owner: str | None
    """The training run (``model_id``) whose key may read the result besides the admin's; None: the admin's
    only."""
    created: float


class FutureStore:
    """Tasks by request id; finished ones are kept for ``keep_s`` seconds after they end (or until
    ``max_kept`` newer ones finished), so a client's retried poll still finds its result."""

    def __init__(self, *, poll_wait: float = 20.0, keep_s: float = 3600.0, max_kept: int = 10_000) -> None:
        self.poll_wait, self.keep_s, self.max_kept = poll_wait, keep_s, max_kept
        self._items: OrderedDict[str, Pending] = OrderedDict()

    def submit(self, work: Awaitable[Any], kind: str, owner: str | None) -> str:
        """Run ``work`` as a task; its request id (random: ids of other runs' requests cannot be guessed)."""
        rid = f"req-{secrets.token_hex(16)}"
        self._items[rid] = Pending(asyncio.ensure_future(work), kind, owner, time.monotonic())
        self._expire()
        return rid

    def get(self, rid: str) -> Pending | None:
        return self._items.get(rid)

    async def wait(self, rid: str, timeout: float | None = None) -> Pending | None:
        """The request's entry once its task is done, or None when still running after the wait."""
        item = self._items.get(rid)
        if item is None:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(item.task), self.poll_wait if timeout is None else timeout)
        except TimeoutError:
            return None
        except Exception:
            pass  # the task's own exception is read by the caller
        return item

    def _expire(self) -> None:
        now = time.monotonic()
        done = [rid for rid, p in self._items.items() if p.task.done()]
        for rid in done[: max(0, len(done) - self.max_kept)]:
            del self._items[rid]
        for rid in [r for r in done if r in self._items and now - self._items[r].created > self.keep_s]:
            del self._items[rid]

    async def close(self) -> None:
        tasks = [p.task for p in self._items.values() if not p.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
