"""``TraceRecorder.record_durably``: a call's future becomes True once its span is committed (readable from
the store at that moment), many calls share a commit, and a span the store never takes makes it False."""

from __future__ import annotations

import asyncio
import time

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.reads import list_spans
from tracegym.gateway.traces.recorder import TraceRecorder
from tracegym.gateway.traces.store import Store


def test_acks_come_after_the_commit_and_calls_share_commits(store: Store) -> None:
    commits = []
    insert = store.insert_spans

    def counted(batch):  # the real insert, counted
        commits.append(len(batch))
        return insert(batch)

    store.insert_spans = counted  # type: ignore[method-assign]
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


def test_calls_recorded_in_one_turn_of_the_event_loop_share_one_commit(sqlite_url: str) -> None:
    # No group delay, nobody said to be in flight: the build thread is woken once the loop has run the
    # callbacks of this turn, not at the first call's record. Each call blocks (GIL released) after its
    # record, as a busy gateway's other work would: a build thread woken at the first record commits it alone.
    store = Store.open(sqlite_url)
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


def _commit_sizes(store: Store) -> list[int]:
    """Each transaction's span count, recorded by wrapping the real insert."""
    sizes: list[int] = []
    insert = store.insert_spans

    def counted(batch):
        sizes.append(len(batch))
        return insert(batch)

    store.insert_spans = counted  # type: ignore[method-assign]
    return sizes


def test_a_call_alone_in_the_gateway_is_committed_without_the_delay(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
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


def test_calls_in_flight_hold_the_group_until_they_have_arrived(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
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


def test_the_group_delay_bounds_the_wait_for_calls_that_do_not_come(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
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
