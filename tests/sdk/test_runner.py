"""The runner in process against the fake gateway: rewards, failures, concurrency, stopping, leases."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest

import tracegym as tg
from tests.sdk import agents
from tests.sdk.fake_gateway import FakeGateway, enqueue, status
from tracegym.runner import Runner, run_agent


async def test_returned_float_completes_with_reward(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{"reward": 0.5}, {"reward": 1}, {"reward": 0}])
    stats = await run_agent(agents.echo_reward, gw.url, 2, exit_when_idle=True, poll_interval=0.05)
    assert status(gw, rids) == [("completed", 0.5), ("completed", 1.0), ("completed", 0.0)]
    assert (stats.done, stats.failed, stats.running, stats.mean_reward) == (3, 0, 0, 0.5)


async def test_exception_fails_with_traceback(gw: FakeGateway) -> None:
    rids = enqueue(gw, ["x"])
    stats = await run_agent(agents.raises, gw.url, exit_when_idle=True, poll_interval=0.05)
    r = gw.state.rollouts[rids[0]]
    assert r["status"] == "failed" and r["error"] == "ValueError: agent broke on 'x'"
    assert "def raises" in r["traceback"] or "in raises" in r["traceback"]
    assert stats.failed == 1 and stats.done == 0


async def test_non_float_return_fails(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{}])
    await run_agent(agents.bad_return, gw.url, exit_when_idle=True, poll_interval=0.05)
    assert "expected a float or None" in gw.state.rollouts[rids[0]]["error"]


async def test_tg_reward_inside_runner_and_headers(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{"reward": 0.25}])
    tg.configure(gateway_url="http://127.0.0.1:1")  # the runner's gateway wins inside its scopes
    stats = await run_agent(agents.reward_via_sdk, gw.url, exit_when_idle=True, poll_interval=0.05)
    assert status(gw, rids) == [("completed", None)] and stats.done == 1
    events = list(gw.state.events[rids[0]].values())
    assert [e.get("value") for e in events] == [0.25, rids[0]]  # reward, then the echoed header


async def test_async_agent_concurrency_bound(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{"reward": 1.0, "sleep": 0.2}] * 6)
    peak, now = 0, 0
    inner = agents.async_agent

    async def counting(task: dict[str, Any], base_url: str) -> float:
        nonlocal peak, now
        now += 1
        peak = max(peak, now)
        try:
            return await inner(task, base_url)
        finally:
            now -= 1

    stats = await run_agent(counting, gw.url, 3, exit_when_idle=True, poll_interval=0.05)
    assert stats.done == 6 and peak == 3  # three at once (not one after another), never four
    assert all(len(gw.state.rewards(r)) == 1 for r in rids)


async def test_sync_agents_run_in_parallel_threads(gw: FakeGateway) -> None:
    enqueue(gw, [{"sleep": 1.0}] * 4)
    start = time.monotonic()
    stats = await run_agent(agents.slow, gw.url, 4, exit_when_idle=True, poll_interval=0.05)
    assert stats.done == 4 and time.monotonic() - start < 3.5  # one after another: at least 4 s


async def test_max_rollouts(gw: FakeGateway) -> None:
    enqueue(gw, [{"reward": 1}] * 5)
    stats = await run_agent(agents.echo_reward, gw.url, 2, max_rollouts=3, poll_interval=0.05)
    assert stats.done == 3 and len(gw.state.queue) == 2


@pytest.mark.parametrize("agent", [agents.slow, agents.async_slow])
async def test_stop_event_releases_after_grace(gw: FakeGateway, agent: Any) -> None:
    rids = enqueue(gw, [{"sleep": 5}] * 2)
    stop = threading.Event()  # a threading.Event works as well as an asyncio.Event
    asyncio.get_running_loop().call_later(0.3, stop.set)
    start = time.monotonic()
    stats = await run_agent(agent, gw.url, 2, stop_event=stop, grace_seconds=0.3, poll_interval=0.05)
    assert time.monotonic() - start < 4.0  # the agents' 5 s were not waited out
    assert stats.released == 2 and stats.done == 0
    assert status(gw, rids) == [("queued", None)] * 2


async def test_stop_lets_short_rollouts_finish(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{"sleep": 0.3}])
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stop.set)
    stats = await run_agent(agents.async_slow, gw.url, stop_event=stop, grace_seconds=5, poll_interval=0.05)
    assert stats.done == 1 and status(gw, rids) == [("completed", 1.0)]


async def test_lost_lease_drops_result(gw: FakeGateway) -> None:
    rids = enqueue(gw, [{"sleep": 0.6}])
    gw.state.lost.add(rids[0])
    stats = await run_agent(agents.slow, gw.url, lease_seconds=0.6, exit_when_idle=True, poll_interval=0.05)
    assert rids[0] in gw.state.heartbeats  # renewed every lease/3
    assert stats.lost == 1 and stats.done == 0
    assert gw.state.rollouts[rids[0]]["status"] == "running"  # nothing written over the new owner


async def test_heartbeat_crossing_the_complete_is_not_a_lost_lease(gw: FakeGateway) -> None:
    a, b = enqueue(gw, [{"sleep": 0.5}, {"wait": True}])
    gw.state.hold_heartbeats.add(a)  # a's heartbeat reaches the gateway after a's complete: 409

    async def agent(task: dict[str, Any], base_url: str) -> float:
        if task.get("wait"):
            # b keeps the runner going until the heartbeat round with a's 409 has been handled: the
            # next round (b's second heartbeat) starts only after it
            deadline = time.monotonic() + 10
            while gw.state.heartbeats.count(b) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(task["sleep"])
        return 1.0

    stats = await run_agent(agent, gw.url, lease_seconds=0.6, exit_when_idle=True, poll_interval=0.05)
    assert a in gw.state.heartbeats, "no heartbeat was sent while a ran: nothing crossed"
    assert (stats.done, stats.lost, stats.failed) == (2, 0, 0)
    assert status(gw, [a, b]) == [("completed", 1.0), ("completed", 1.0)]


async def test_reclaimed_rollout_keeps_its_new_run(gw: FakeGateway) -> None:
    """A sync run whose lease was lost runs on (a thread cannot be stopped); the gateway requeues the
    rollout and this runner claims it back. The abandoned run ending must not drop the new run's flight."""
    (rid,) = enqueue(gw, [{}])
    gw.state.lost.add(rid)  # the first run's heartbeat finds its lease lost
    second_started, first_ended = threading.Event(), threading.Event()
    calls = itertools.count()

    def agent(task: Any, base_url: str) -> float:
        if next(calls) == 0:  # the abandoned run: it ends while the second one is in flight
            assert second_started.wait(10)
            first_ended.set()
        else:
            second_started.set()
            assert first_ended.wait(10)
            # room for the loop to drop the first run's flight before this one ends (without it the
            # test would pass on a runner that dropped the wrong flight, never fail on a correct one)
            time.sleep(0.2)
        return 1.0

    runner = Runner(agent, gw.url, lease_seconds=0.6, exit_when_idle=True, poll_interval=0.05)
    task = asyncio.create_task(runner.run())
    deadline = time.monotonic() + 5
    while runner.stats.lost == 0:
        assert time.monotonic() < deadline, "the lease was never found lost"
        await asyncio.sleep(0.01)
    with gw.state.lock:  # the gateway requeues it and the runner claims it back: a second run starts
        gw.state.lost.discard(rid)
        gw.state.rollouts[rid]["status"] = "queued"
        gw.state.queue.append(gw.state.rollouts[rid])
    stats = await asyncio.wait_for(task, 20)
    assert first_ended.is_set()
    assert (stats.lost, stats.done, stats.failed) == (1, 1, 0)
    assert status(gw, [rid]) == [("completed", 1.0)]


async def test_nan_return_fails_the_rollout(gw: FakeGateway) -> None:
    (rid,) = enqueue(gw, [{}])
    stats = await run_agent(agents.nan_reward, gw.url, exit_when_idle=True, poll_interval=0.05)
    r = gw.state.rollouts[rid]
    assert r["status"] == "failed" and (stats.done, stats.failed) == (0, 1)
    assert r["error"].startswith("ValueError: the agent returned float nan")
    assert "must be finite" in r["error"] and "expected a float or None" in r["error"]
    assert gw.state.finish_calls == [("fail", rid)]


async def test_refused_result_fails_with_the_gateways_message(gw: FakeGateway) -> None:
    (rid,) = enqueue(gw, [{"reward": 1.0}])
    gw.state.reject_complete = "reward out of range"
    stats = await run_agent(agents.echo_reward, gw.url, exit_when_idle=True, poll_interval=0.05)
    r = gw.state.rollouts[rid]
    assert (stats.done, stats.failed) == (0, 1)
    assert r["status"] == "failed" and "reward out of range" in r["error"]
    assert gw.state.finish_calls == [("complete", rid), ("fail", rid)]  # a 4xx is not retried


@pytest.mark.parametrize(
    ("agent", "calls"),
    [(agents.echo_reward, ["complete"] * 5), (agents.raises, ["fail"])],  # 5 tries: the gw fixture's retries
)
async def test_unreportable_result_counts_as_failed(
    gw: FakeGateway, caplog: pytest.LogCaptureFixture, agent: Any, calls: list[str]
) -> None:
    (rid,) = enqueue(gw, [{"reward": 1.0}])
    gw.state.fail_finish = 100  # complete and fail answer 503 (complete is retried; fail is not)
    stats = await run_agent(agent, gw.url, exit_when_idle=True, poll_interval=0.05)
    assert (stats.done, stats.failed, stats.running) == (0, 1, 0)
    assert gw.state.finish_calls == [(c, rid) for c in calls]
    assert gw.state.rollouts[rid]["status"] == "running"  # left to its lease; the gateway requeues it
    assert f"rollout {rid}: could not report its result" in caplog.text


async def test_claim_errors_after_the_first_claim_are_retried(gw: FakeGateway) -> None:
    enqueue(gw, [{"sleep": 0.3}])
    task = asyncio.create_task(run_agent(agents.async_slow, gw.url, max_rollouts=2, poll_interval=0.05))
    deadline = time.monotonic() + 5
    while gw.state.queue:  # until the first claim went through
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # the two claims after this task is queued answer 503 (armed as it is queued: a claim in flight
    # cannot slip in between); the client does not repeat a claim (it is not idempotent), the runner
    # claims again at its next poll
    gw.state.fail_on_enqueue = 2
    enqueue(gw, [{"sleep": 0}])
    stats = await asyncio.wait_for(task, 10)
    assert stats.done == 2 and gw.state.fail_next == 0


async def test_unreachable_gateway_fails_fast() -> None:
    from tests.procs import free_port

    tg.configure(retry_attempts=2, retry_backoff=0.01)
    with pytest.raises(tg.GatewayUnreachableError, match="claim rollouts"):
        await run_agent(agents.echo_reward, f"http://127.0.0.1:{free_port()}", exit_when_idle=True)


async def test_agent_given_as_a_target_string(gw: FakeGateway) -> None:
    (rid,) = enqueue(gw, [{"reward": 0.5}])
    stats = await run_agent(
        "tests/sdk/agents.py:echo_reward", gw.url, exit_when_idle=True, poll_interval=0.05
    )
    assert stats.done == 1 and status(gw, [rid]) == [("completed", 0.5)]


def test_runner_checks_its_settings() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Runner(agents.slow, concurrency=0)
    with pytest.raises(ValueError, match="lease_seconds"):
        Runner(agents.slow, lease_seconds=0)
