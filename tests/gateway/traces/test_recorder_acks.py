"""``TraceRecorder.record_durably``: a call's future becomes True once its span is committed (readable from
the store at that moment), many calls share a commit, and a span the store never takes makes it False."""

from __future__ import annotations

import asyncio

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
