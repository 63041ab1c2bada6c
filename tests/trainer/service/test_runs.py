"""A run's ordering rule: requests run one at a time in ``seq_id`` order whatever order they arrive in, a
``seq_id`` taken twice is a conflict, and a gap that is never filled fails the requests behind it; futures
have random ids and record their owner."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tracegym.trainer.service.futures import FutureStore, UserFault
from tracegym.trainer.service.runs import Run, SeqConflict


def _run() -> Run:
    return Run("s:train:0", "tiny-random", None, None, Path("."), {})


async def test_requests_run_in_seq_order_whatever_order_they_arrive_in() -> None:
    run, ran = _run(), []

    async def request(seq: int) -> None:
        async with run.ordered(run.claim(seq), gap_timeout=5):
            ran.append(seq)
            await asyncio.sleep(0.01)  # one at a time: nothing else starts meanwhile
            ran.append(-seq)

    await asyncio.gather(request(3), request(1), request(2))
    assert ran == [1, -1, 2, -2, 3, -3]
    async with run.ordered(run.claim(None), gap_timeout=5):  # no seq_id: the next free one
        assert run.next_seq == 4


async def test_a_seq_id_taken_twice_is_a_conflict_naming_the_next_expected() -> None:
    run = _run()
    run.claim(1)
    with pytest.raises(SeqConflict, match=r"another client is stepping this run.*next expected: 2"):
        run.claim(1)
    async with run.ordered(1, gap_timeout=5):
        pass
    with pytest.raises(SeqConflict):
        run.claim(1)  # already run
    assert run.claim(2) == 2


async def test_a_gap_never_filled_fails_the_request_behind_it() -> None:
    run = _run()
    seq = run.claim(2)
    with pytest.raises(UserFault, match="seq_id 2 waited 0 s for seq_id 1"):
        async with run.ordered(seq, gap_timeout=0.05):
            pass


async def test_a_future_runs_on_when_nobody_polls_and_is_answered_later() -> None:
    store = FutureStore(poll_wait=0.01)

    async def work() -> int:
        await asyncio.sleep(0.05)
        return 42

    rid = store.submit(work(), "optim_step", "s:train:0")
    assert await store.wait(rid) is None  # still running: try again
    item = await store.wait(rid, timeout=5)
    assert item is not None and item.task.result() == 42
    assert await store.wait("req-unknown") is None


async def test_request_ids_are_random_and_each_future_records_its_owner() -> None:
    store = FutureStore()

    async def work() -> None:
        return None

    first, second = store.submit(work(), "sample", "s:train:0"), store.submit(work(), "create_model", None)
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", rid) for rid in (first, second)) and first != second
    assert (store.get(first).owner, store.get(second).owner) == ("s:train:0", None)  # type: ignore[union-attr]
    await store.close()
