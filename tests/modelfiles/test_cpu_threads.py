"""``cpu_threads.in_own_thread``: the work runs off the event loop's thread, in a thread that has ended by the
time its result arrives (so the OpenMP pool torch gave it has ended too), and its exceptions reach the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tracegym.modelfiles.cpu_threads import in_own_thread


def test_the_work_runs_in_a_thread_that_ends_and_its_errors_reach_the_caller() -> None:
    ran: list[threading.Thread] = []

    def work(x: int) -> int:
        ran.append(threading.current_thread())
        return x * 2

    def fails() -> None:
        raise ValueError("bad checkpoint")

    async def main() -> None:
        assert await in_own_thread(work, 21) == 42
        assert ran[0] is not threading.current_thread() and ran[0] is not threading.main_thread()
        ran[0].join(timeout=5)
        assert not ran[0].is_alive()
        with pytest.raises(ValueError, match="bad checkpoint"):
            await in_own_thread(fails)
        assert await in_own_thread(work, 1) == 2 and ran[1] is not ran[0]  # a new thread each time

    asyncio.run(main())


def test_a_caller_that_goes_away_leaves_the_work_to_finish_quietly() -> None:
    release = threading.Event()

    def slow() -> int:
        release.wait(5)
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(in_own_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.1)  # the thread's late result finds its caller gone: nothing raised

    asyncio.run(main())
