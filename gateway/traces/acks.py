"""Commit acknowledgements for the span recorder (``recorder.TraceRecorder.record_durably``).

A call that must not be answered before its span is committed hands the recorder an ``asyncio.Future``
made on its event loop (an ``Ack``); the record travels the recorder's queue with it, whoever encodes the
queue keeps the acks of each encoded batch next to the batch (``Built``), and whoever writes the batch
settles them once its transaction committed (``True``) or was given up (``False``). Many calls share one
commit (group commit). On SQLite that is mostly the event loop itself, at the end of the turn in which its
calls recorded (``recorder.StoreSpanProcessor._commit_here``), settling its own acks directly; else the
build and write threads, and each batch costs one ``call_soon_threadsafe`` per event loop, not one per call.

``CommitGroup`` decides when the calls waiting in the threads are committed. A transaction costs about as
much for one span as for ten (SQLite: its statements and commit; PostgreSQL: the server's WAL flush), and
calls arrive too far apart for a transaction to find company by itself, so the build thread holds the
first waiting call's span up to ``delay_s`` for the calls still on their way, as PostgreSQL's
``commit_delay`` does when ``commit_siblings`` other transactions are open. A call on its way is one in
flight in the gateway (``in_flight``, the admission count) that has not handed in its record: with none
(one client at a time), the group is committed at once and waits nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tracegym.gateway.traces.store.span_rows import SpanBatch

Ack = asyncio.Future
"""``Future[bool]``: True once the span is committed, False when it was lost (counted as dropped)."""


@dataclass(slots=True)
class Built:
    """An encoded batch and the acks of the spans in it (in the recorder's write queue)."""

    batch: SpanBatch
    acks: list[Ack] = field(default_factory=list)


def _resolve(acks: list[Ack], ok: bool) -> None:
    for a in acks:
        if not a.done():  # a caller that went away cancelled its wait
            a.set_result(ok)


def settle(acks: Iterable[Ack], ok: bool, here: asyncio.AbstractEventLoop | None = None) -> None:
    """Resolve ``acks`` from any thread, one callback per event loop; those of ``here`` (the loop running
    this call, if it is one) at once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Ack]] = {}
    for a in acks:
        by_loop.setdefault(a.get_loop(), []).append(a)
    for loop, group in by_loop.items():
        if loop is here:
            _resolve(group, ok)
            continue
        try:
            loop.call_soon_threadsafe(_resolve, group, ok)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            continue


def settle_now(ack: Ack | None, ok: bool) -> None:
    """Resolve one ack on its own loop's thread (a span refused as it is queued)."""
    if ack is not None and not ack.done():
        ack.set_result(ok)


class CommitGroup:
    """The build thread's open group of calls waiting for their commit, and when it is due (see the module
    docstring). ``queued`` is counted by the calls' event loop, ``lost`` by the build thread, ``settled``
    by the threads that export (``add_settled``: on PostgreSQL two may commit at once)."""

    __slots__ = ("_settled_lock", "built", "delay_s", "in_flight", "lost", "queued", "settled", "since")

    def __init__(self, delay_s: float, in_flight: Callable[[], int] | None = None) -> None:
        self.delay_s = delay_s
        self.in_flight = in_flight
        self.built: Built | None = None
        self.since = 0.0
        self.queued = self.settled = self.lost = 0
        self._settled_lock = threading.Lock()

    def add_settled(self, n: int) -> None:
        with self._settled_lock:
            self.settled += n

    def expected(self) -> int:
        """Calls in flight that have not handed in their record yet (0 when the gateway does not say)."""
        if self.in_flight is None:
            return 0
        return self.in_flight() - (self.queued - self.settled - self.lost)

    def add(self, built: Built) -> None:
        if self.built is None:
            self.built, self.since = built, time.monotonic()
        else:
            self.built.batch.extend(built.batch)
            self.built.acks += built.acks

    def due(self, max_rows: int) -> bool:
        """Commit the open group now: it is full, its first call waited ``delay_s``, or nobody else comes."""
        b = self.built
        return b is not None and (len(b.batch) >= max_rows or self.expected() <= 0
                                  or time.monotonic() - self.since >= self.delay_s)

    def take(self) -> Built | None:
        built, self.built = self.built, None
        return built

    def wait_s(self, idle_s: float) -> float:
        """How long the build thread may sleep: until the open group's deadline, else ``idle_s``."""
        if self.built is None:
            return idle_s
        return max(0.0, self.since + self.delay_s - time.monotonic())
