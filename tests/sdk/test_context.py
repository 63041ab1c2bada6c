"""Rollout scopes: nesting, decorators (sync, async, bare), threads and asyncio tasks."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

import tracegym as tg


def test_no_scope_outside() -> None:
    assert tg.current_rollout() is None


def test_context_manager_sets_and_restores() -> None:
    with tg.rollout(task_id="t1", rollout_id="r1", agent_name="a") as scope:
        assert tg.current_rollout() is scope
        assert scope.headers() == {"X-Rollout-Id": "r1", "X-Task-Id": "t1", "X-Agent-Name": "a"}
    assert tg.current_rollout() is None


def test_fresh_ids_per_scope() -> None:
    with tg.rollout() as a:
        pass
    with tg.rollout() as b:
        pass
    assert a.rollout_id != b.rollout_id
    assert a.headers() == {"X-Rollout-Id": a.rollout_id}


def test_nested_scopes() -> None:
    with tg.rollout(task_id="t", rollout_id="outer") as outer:
        with tg.rollout(agent_name="critic") as inner:  # same rollout, tagged agent
            assert (inner.rollout_id, inner.task_id, inner.agent_name) == ("outer", "t", "critic")
        with tg.rollout(rollout_id="other") as other:  # explicit id: a separate rollout
            assert other.rollout_id == "other" and other.task_id is None
        with tg.rollout(task_id="t2") as new_task:  # another task: a new rollout
            assert new_task.rollout_id != "outer" and new_task.task_id == "t2"
        assert tg.current_rollout() is outer
    assert tg.current_rollout() is None


def test_same_object_reentered() -> None:
    r = tg.rollout(task_id="t")
    with r as a:
        with r as inner:  # nested with the same task: the same rollout
            assert tg.current_rollout() is inner and inner.rollout_id == a.rollout_id
        assert tg.current_rollout() is a
    with r as b:  # entered again later: a new rollout
        assert b.rollout_id != a.rollout_id
    assert tg.current_rollout() is None


def test_scope_restored_after_exception() -> None:
    with pytest.raises(KeyError), tg.rollout():
        raise KeyError("x")
    assert tg.current_rollout() is None


def test_decorator_sync_each_call_is_a_rollout() -> None:
    @tg.rollout(task_id="deco")
    def agent(x: int) -> tuple[int, str, str | None]:
        s = tg.current_rollout()
        assert s is not None
        return x, s.rollout_id, s.task_id

    (x1, r1, t1), (x2, r2, _) = agent(1), agent(2)
    assert (x1, x2, t1) == (1, 2, "deco") and r1 != r2
    assert agent.__name__ == "agent"
    assert tg.current_rollout() is None


async def test_decorator_async_and_bare() -> None:
    @tg.rollout
    async def bare() -> str:
        await asyncio.sleep(0)
        s = tg.current_rollout()
        assert s is not None
        return s.rollout_id

    @tg.rollout(agent_name="solver")
    async def named() -> str | None:
        s = tg.current_rollout()
        return s.agent_name if s else None

    assert asyncio.iscoroutinefunction(bare)
    ids = await asyncio.gather(bare(), bare())
    assert len(set(ids)) == 2
    assert await named() == "solver"
    assert tg.current_rollout() is None


async def test_async_with_and_tasks_see_their_own_rollout() -> None:
    async def worker(i: int) -> tuple[str, str]:
        async with tg.rollout(rollout_id=f"r{i}"):
            await asyncio.sleep(0.01 * (3 - i))  # interleave
            inner = asyncio.create_task(asyncio.sleep(0, result=tg.current_rollout()))
            s = tg.current_rollout()
            assert s is not None
            return s.rollout_id, (await inner).rollout_id

    got = await asyncio.gather(*(worker(i) for i in range(3)))
    assert got == [(f"r{i}", f"r{i}") for i in range(3)]
    assert tg.current_rollout() is None


async def test_to_thread_inherits_scope() -> None:
    async with tg.rollout(rollout_id="async-r"):
        s = await asyncio.to_thread(tg.current_rollout)
    assert s is not None and s.rollout_id == "async-r"


def test_threads_see_the_right_rollout() -> None:
    results: dict[int, str | None] = {}
    barrier = threading.Barrier(4)

    def own_scope(i: int) -> None:
        with tg.rollout(rollout_id=f"t{i}"):
            barrier.wait()  # all four scopes open at once
            s = tg.current_rollout()
            results[i] = s.rollout_id if s else None

    threads = [threading.Thread(target=own_scope, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"t{i}" for i in range(4)}

    seen: list[object] = []
    with tg.rollout(rollout_id="parent"):
        bare = threading.Thread(target=lambda: seen.append(tg.current_rollout()))
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=lambda: ctx.run(lambda: seen.append(tg.current_rollout())))
        bare.start(), bare.join(), copied.start(), copied.join()
    assert seen[0] is None  # a bare thread starts with an empty context
    assert getattr(seen[1], "rollout_id", None) == "parent"


def test_configure_applies_to_new_scopes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEGYM_GATEWAY", "http://gw.example:9000/")
    with tg.rollout() as s:
        assert s.config.gateway_url == "http://gw.example:9000"
    tg.configure(gateway_url="http://other:1234", api_key="k")
    with tg.rollout() as s:
        assert (s.config.gateway_url, s.config.api_key) == ("http://other:1234", "k")
    with pytest.raises(ValueError, match="http"):
        tg.configure(gateway_url="gw:8000")
