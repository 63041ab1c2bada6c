"""``TraceRecorder.record_durably``: a call's future becomes True once its span is committed (readable from
the store at that moment), many calls share a commit, and a span the store never takes makes it False."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.recorder import TraceRecorder
from tracegym.gateway.traces.store import Store


def test_acks_come_after_the_commit_and_calls_share_commits(store: Store) -> None:
    commits = _commit_sizes(store)
    rec = TraceRecorder(store, schedule_delay_s=30.0)  # nothing would be written without the acks' wake-up

    async def calls() -> list[bool]:
        async def one(i: int) -> bool:
            ok = await rec.record_durably(make_record(i, rollout_id=f"ro-ack-{i}"))
            assert len(list_spans(store, f"ro-ack-{i}")) == 1  # committed before the ack
            return ok

        return await asyncio.gather(*(one(i) for i in range(200)))

    try:
        assert asyncio.run(calls()) == [True] * 200
    finally:
        rec.shutdown()
    assert sum(commits) == 200 and len(commits) < 200, commits  # group commit: shared transactions


def test_calls_recorded_in_one_turn_of_the_event_loop_share_one_commit(store_url: str) -> None:
    # No group delay, nobody said to be in flight: the commit starts once the loop has run the callbacks of
    # this turn (SQLite: on the loop; PostgreSQL: the build thread is woken), not at the first call's record.
    # Each call blocks (GIL released) after its record, as a busy gateway's other work would: a build thread
    # woken at the first record would commit it alone.
    store = Store.open(store_url)
    sizes = _commit_sizes(store)
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=0.0)

    async def one(i: int) -> bool:
        ack = rec.record_durably(make_record(i, rollout_id=f"ro-turn-{i}"))
        time.sleep(0.02)
        return await ack

    async def turns() -> list[bool]:  # eight calls' first steps in one turn, then eight more
        first = await asyncio.gather(*(one(i) for i in range(8)))
        return first + await asyncio.gather(*(one(i) for i in range(8, 16)))

    try:
        assert asyncio.run(turns()) == [True] * 16
    finally:
        rec.shutdown()
        store.close()
    assert sizes == [8, 8]


class FailingStore:
    def insert_spans(self, batch: object) -> int:
        raise RuntimeError("database is gone")


def test_a_span_the_store_never_takes_is_a_false_ack() -> None:
    rec = TraceRecorder(FailingStore(), schedule_delay_s=30.0)
    rec.exporter.retries = 1

    async def call() -> bool:
        return await rec.record_durably(make_record(0))

    try:
        assert asyncio.run(call()) is False
    finally:
        rec.shutdown()


def _commit_sizes(store: Store, threads: list[int] | None = None) -> list[int]:
    """Each transaction's span count, recorded by wrapping the real inserts (the write thread's and the
    event loop's), and with ``threads`` the thread that ran each."""
    sizes: list[int] = []

    def counting(insert):
        def counted(batch):
            n = insert(batch)  # raises, nothing counted, when the store is busy
            sizes.append(len(batch))
            if threads is not None:
                threads.append(threading.get_ident())
            return n
        return counted

    store.insert_spans = counting(store.insert_spans)  # type: ignore[method-assign]
    store.insert_spans_now = counting(store.insert_spans_now)  # type: ignore[method-assign]
    return sizes


def test_a_call_alone_in_the_gateway_is_committed_without_the_delay(store_url: str) -> None:
    store = Store.open(store_url)
    sizes = _commit_sizes(store)
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=30.0, in_flight=lambda: 1)

    async def calls() -> list[float]:
        waits = []
        for i in range(3):  # one at a time, as one client does
            t = time.monotonic()
            assert await rec.record_durably(make_record(i, rollout_id=f"ro-alone-{i}"))
            waits.append(time.monotonic() - t)
        return waits

    try:
        assert max(asyncio.run(calls())) < 5.0  # nobody else in flight: the 30 s delay never applies
    finally:
        rec.shutdown()
        store.close()
    assert sizes == [1, 1, 1]


# The commit group's wait for calls in flight applies where the event loop does not commit itself: on
# PostgreSQL, and on SQLite while another writer holds the lock.


@pytest.mark.pg
def test_calls_in_flight_hold_the_group_until_they_have_arrived(pg_url: str) -> None:
    store = Store.open(pg_url)
    sizes = _commit_sizes(store)
    in_flight = 8
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=30.0, in_flight=lambda: in_flight)

    async def calls() -> list[bool]:
        async def one(i: int) -> bool:
            await asyncio.sleep(0.02 * i)  # arriving one after another, each alone in the queue
            return await rec.record_durably(make_record(i, rollout_id=f"ro-group-{i}"))

        return await asyncio.gather(*(one(i) for i in range(in_flight)))

    try:
        t = time.monotonic()
        assert asyncio.run(calls()) == [True] * in_flight
        assert time.monotonic() - t < 10.0  # committed once the last one came, not after the delay
    finally:
        rec.shutdown()
        store.close()
    assert sizes == [in_flight]  # one transaction for all of them


@pytest.mark.pg
def test_the_group_delay_bounds_the_wait_for_calls_that_do_not_come(pg_url: str) -> None:
    store = Store.open(pg_url)
    sizes = _commit_sizes(store)
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=0.2, in_flight=lambda: 5)

    async def call() -> float:
        t = time.monotonic()
        assert await rec.record_durably(make_record(0, rollout_id="ro-late"))
        return time.monotonic() - t

    try:
        waited = asyncio.run(call())
    finally:
        rec.shutdown()
        store.close()
    assert 0.15 < waited < 10.0, waited  # four calls "in flight" never record: the delay ends the wait
    assert sizes == [1]


def test_on_sqlite_the_event_loop_commits_its_calls_itself(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
    threads: list[int] = []
    sizes = _commit_sizes(store, threads)
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=30.0, in_flight=lambda: 4)

    async def calls() -> list[bool]:
        acks = [rec.record_durably(make_record(i, rollout_id=f"ro-loop-{i}")) for i in range(3)]
        return [await a for a in acks]

    loop_thread = []

    async def main() -> list[bool]:
        loop_thread.append(threading.get_ident())
        return await calls()

    try:
        assert asyncio.run(main()) == [True] * 3
        assert len(list_spans(store, "ro-loop-2")) == 1
    finally:
        rec.shutdown()
        store.close()
    assert sizes == [3] and threads == loop_thread  # at the end of the turn, no hand-off, no group delay


def test_a_locked_sqlite_store_hands_the_commit_to_the_write_thread(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
    store.ensure_rollout("ro-first")  # the file and its tables exist
    threads: list[int] = []
    sizes = _commit_sizes(store, threads)
    rec = TraceRecorder(store, schedule_delay_s=30.0, commit_delay_s=0.0)
    other = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's writer holds the lock

    async def call() -> tuple[bool, float]:
        t = time.monotonic()
        ack = rec.record_durably(make_record(0, rollout_id="ro-locked"))
        ticks = 0
        while not ack.done() and ticks < 20:  # the loop runs on while the span waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert not ack.done() and ticks == 20
        other.execute("COMMIT")
        return await ack, time.monotonic() - t

    try:
        ok, waited = asyncio.run(call())
        assert ok and 0.2 <= waited < 10.0
        assert len(list_spans(store, "ro-locked")) == 1
    finally:
        rec.shutdown()
        other.close()
        store.close()
    assert sizes == [1] and threads != [threading.get_ident()]  # committed by the write thread


class ThreadNamingStore:
    """Records which thread wrote each batch; ``dialect`` says whether two batches may commit at once."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.writers: list[str] = []

    def insert_spans(self, batch: object) -> int:
        self.writers.append(threading.current_thread().name)
        return len(batch)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dialect", "side_by_side"), [("postgresql", True), ("sqlite", False)])
def test_a_group_is_committed_beside_a_busy_writer_only_where_the_store_allows(dialect: str,
                                                                               side_by_side: bool) -> None:
    # The test holds the write lock, as the write thread does while it commits a batch: on PostgreSQL the
    # build thread commits the group beside it; on a one-writer store the group waits for the lock.
    store = ThreadNamingStore(dialect)
    rec = TraceRecorder(store, schedule_delay_s=30.0)
    assert rec.exporter.writes_side_by_side is side_by_side

    async def call() -> bool:
        ack = rec.record_durably(make_record(0))
        done, _ = await asyncio.wait({ack}, timeout=0.5)
        committed_while_locked = bool(done)
        rec.processor._write_lock.release()
        assert await asyncio.wait_for(ack, 10.0)
        return committed_while_locked

    rec.processor._write_lock.acquire()
    try:
        assert asyncio.run(call()) is side_by_side
    finally:
        rec.shutdown()
    assert store.writers == ["tracegym-span-build" if side_by_side else "tracegym-span-write"]
