"""The runner against the fake gateway: rewards, failures, concurrency, stopping, leases, the CLI."""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tracegym as tg
from tests.procs import ManagedProcess, start_process
from tests.sdk import agents
from tests.sdk.fake_gateway import FakeGateway
from tracegym.client import GatewayClient
from tracegym.runner import Runner, as_reward, enqueue_main, load_target, read_tasks, run_agent

REPO = Path(__file__).resolve().parents[2]


def enqueue(gw: FakeGateway, inputs: list[Any], group_size: int = 1) -> list[str]:
    with GatewayClient() as c:
        out = c.enqueue_tasks([{"input": i} for i in inputs], group_size=group_size)
    return [rid for t in out for rid in t["rollout_ids"]]


def status(gw: FakeGateway, rids: list[str]) -> list[tuple[str, Any]]:
    return [(gw.state.rollouts[r]["status"], gw.state.rollouts[r]["reward"]) for r in rids]


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

    start = time.monotonic()
    stats = await run_agent(counting, gw.url, 3, exit_when_idle=True, poll_interval=0.05)
    assert stats.done == 6 and peak == 3
    assert time.monotonic() - start < 1.5  # 2 waves of 0.2 s, not 6 in series
    assert all(len(gw.state.rewards(r)) == 1 for r in rids)


async def test_sync_agents_run_in_parallel_threads(gw: FakeGateway) -> None:
    enqueue(gw, [{"sleep": 0.3}] * 4)
    start = time.monotonic()
    stats = await run_agent(agents.slow, gw.url, 4, exit_when_idle=True, poll_interval=0.05)
    assert stats.done == 4 and time.monotonic() - start < 1.0


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
    assert time.monotonic() - start < 2.0
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


async def test_reclaimed_rollout_keeps_its_new_run(gw: FakeGateway) -> None:
    (rid,) = enqueue(gw, [{"sleep": 0.8}])
    gw.state.lost.add(rid)  # the first run's heartbeat finds its lease lost; its sync agent runs on
    runner = Runner(agents.slow, gw.url, lease_seconds=0.6, exit_when_idle=True, poll_interval=0.05)
    task = asyncio.create_task(runner.run())
    deadline = time.monotonic() + 5
    while runner.stats.lost == 0:
        assert time.monotonic() < deadline, "the lease was never found lost"
        await asyncio.sleep(0.01)
    with gw.state.lock:  # the gateway requeues it and the runner claims it back: a second run starts
        gw.state.lost.discard(rid)
        gw.state.rollouts[rid]["status"] = "queued"
        gw.state.queue.append(gw.state.rollouts[rid])
    stats = await asyncio.wait_for(task, 10)
    # the abandoned first run ending (~0.8 s) must not drop the second run's flight (ends ~0.3 s later)
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


def test_as_reward() -> None:
    assert as_reward(None) is None and as_reward(1) == 1.0 and as_reward(0.5) == 0.5
    for bad, err in [
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("1", TypeError),
    ]:
        with pytest.raises(err, match="expected a float or None"):
            as_reward(bad)


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
    enqueue(gw, [{"sleep": 0}])  # blocks the loop: no claim can come between these two lines
    # the next two claims answer 503: the client does not repeat a claim (it is not idempotent), the
    # runner claims again at its next poll
    gw.state.fail_next = 2
    stats = await asyncio.wait_for(task, 10)
    assert stats.done == 2 and gw.state.fail_next == 0


async def test_unreachable_gateway_fails_fast() -> None:
    from tests.procs import free_port

    tg.configure(retry_attempts=2, retry_backoff=0.01)
    with pytest.raises(tg.GatewayUnreachableError, match="claim rollouts"):
        await run_agent(agents.echo_reward, f"http://127.0.0.1:{free_port()}", exit_when_idle=True)


def test_load_target(tmp_path: Path) -> None:
    assert load_target("tests.sdk.agents:echo_reward") is agents.echo_reward
    f = tmp_path / "my_agent.py"
    f.write_text("def agent(task, base_url):\n    return 1.0\n")
    assert load_target(f"{f}:agent")({}, "") == 1.0
    for bad, err in [
        ("nocolon", ValueError),
        (f"{f}:missing", AttributeError),
        ("x.py:f", FileNotFoundError),
    ]:
        with pytest.raises(err):
            load_target(bad)
    with pytest.raises(ValueError, match="concurrency"):
        Runner(agents.slow, concurrency=0)


def test_read_tasks(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"task_id": "a", "input": {"q": 1}}\n\n{"q": 2}\n"plain"\n{"input": 3, "split": "test"}\n')
    assert read_tasks(f) == [
        {"task_id": "a", "input": {"q": 1}},
        {"input": {"q": 2}},
        {"input": "plain"},
        {"input": 3, "split": "test"},
    ]
    f.write_text('{"input": 1, "answer": 2}\n')
    with pytest.raises(ValueError, match="unknown task fields"):
        read_tasks(f)
    f.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1: not valid JSON"):
        read_tasks(f)


def test_enqueue_main(gw: FakeGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"task_id": "a", "input": 1}\n{"q": 2}\n')
    args = argparse.Namespace(dataset=str(f), gateway=gw.url, group_size=3, max_attempts=2)
    assert enqueue_main(args) == 0
    assert "enqueued 2 tasks, 6 rollouts" in capsys.readouterr().out
    assert [r["task_id"] for r in gw.state.queue].count("a") == 3 and len(gw.state.queue) == 6


def _cli(args: list[str], tmp_path: Path) -> ManagedProcess:
    """``tracegym ARGS`` in its own process group, output in a log: ``with`` kills it whatever happens."""
    log = tmp_path / f"cli-{time.monotonic_ns()}.log"
    env = {"PYTHONPATH": str(REPO)}
    return start_process(["tracegym", *args], port=None, log_path=log, env=env, cwd=REPO)


def test_cli_run_exit_when_idle(gw: FakeGateway, tmp_path: Path) -> None:
    rids = enqueue(gw, [{"reward": 1.0}, {"reward": 0.0}])
    args = ["run", "tests/sdk/agents.py:echo_reward", "--gateway", gw.url, "--exit-when-idle"]
    with _cli(args, tmp_path) as run:
        returncode = run.proc.wait(timeout=60)
        err = run.log()
    assert returncode == 0, err
    assert status(gw, rids) == [("completed", 1.0), ("completed", 0.0)]
    assert "done 2 | failed 0 | running 0 | mean reward 0.500" in err  # the final progress line


def test_cli_sigint_releases_in_flight(gw: FakeGateway, tmp_path: Path) -> None:
    rids = enqueue(gw, [{"sleep": 30}])
    with _cli(["run", "tests.sdk.agents:slow", "--gateway", gw.url], tmp_path) as run:
        deadline = time.monotonic() + 30
        while gw.state.rollouts[rids[0]]["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        run.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        run.proc.send_signal(signal.SIGINT)  # the second one skips the grace period
        returncode = run.proc.wait(timeout=20)
        err = run.log()
    assert returncode == 0, err
    assert status(gw, rids) == [("queued", None)]
    assert "released 1" in err
