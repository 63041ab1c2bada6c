"""A rollout rewarded or finished with no LLM call attributed to it: flagged with the event
``tracegym.no_calls`` (its attributes naming the likely cause), warned about once per process, never
failing the agent; and left alone when its calls were attributed, seen by the scope or by the gateway."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import tracegym as tg
from tests.procs import free_port
from tests.sdk import agents
from tests.sdk.fake_gateway import FakeGateway
from tracegym.attribution import NO_CALLS_EVENT
from tracegym.client import GatewayClient
from tracegym.runner import run_agent

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _short_span_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake gateway has a call's span as soon as it answered: the check's pauses for a real gateway's
    recording lag (``SPAN_LAG_WAITS``, a second in all) would only make each flagged rollout here a second
    longer. (A script run in a process of its own keeps them.)"""
    monkeypatch.setattr("tracegym.attribution.SPAN_LAG_WAITS", (0.01, 0.02))


def join_checks() -> None:
    """Wait for the checks running in the background (their threads are named after the rollout)."""
    for t in threading.enumerate():
        if t.name.startswith("tracegym-check-"):
            t.join(timeout=30)


def checking(rid: str) -> bool:
    """A check of ``rid`` is still running (it takes a second when the gateway has no span)."""
    return any(t.name == f"tracegym-check-{rid}" and t.is_alive() for t in threading.enumerate())


def flags(gw: FakeGateway, rid: str) -> list[dict[str, Any]]:
    """The rollout's ``tracegym.no_calls`` events, once the checks started so far are done."""
    join_checks()
    return [e for e in gw.state.events.get(rid, {}).values() if e.get("name") == NO_CALLS_EVENT]


def test_reward_without_calls_is_flagged_naming_the_cause(
    gw: FakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tracegym.attribution")
    with tg.rollout(task_id="t", rollout_id="nc"):
        out = tg.reward(1.0)  # the agent is not failed: the reward is delivered and returned
        assert checking("nc")  # ... nor slowed down: the check runs in the background
    assert out["duplicate"] is False and [e["value"] for e in gw.state.rewards("nc")] == [1.0]
    (flag,) = flags(gw, "nc")  # one flag: the scope's end does not check again
    assert flag["kind"] == "event" and flag["idempotency_key"] == NO_CALLS_EVENT  # one per rollout
    attrs = flag["attributes"]
    assert attrs["when"] == "reward" and attrs["gateway"] == gw.url and attrs["calls_elsewhere"] == []
    assert "client tracegym does not instrument" in attrs["cause"] and "httpx2" in attrs["cause"]
    assert "httpx" in attrs["instrumented"]
    assert any("rollout nc" in r.getMessage() and r.levelno >= logging.INFO for r in caplog.records)


def test_calls_to_another_host_are_named(gw: FakeGateway) -> None:
    with FakeGateway() as other, tg.rollout(rollout_id="elsewhere"):
        client = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="fake", messages=MSGS)
        tg.reward(0.0)
    (flag,) = flags(gw, "elsewhere")
    assert flag["attributes"]["calls_elsewhere"] == [other.url]
    assert flag["attributes"]["cause"] == f"its LLM calls went to {other.url}, not to the gateway at {gw.url}"


def test_attributed_calls_are_not_flagged(gw: FakeGateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with tg.rollout(rollout_id="ok"):
        with tg.rollout(agent_name="critic"):  # a nested scope of the same rollout shares the count
            client.chat.completions.create(model="fake", messages=MSGS)
        tg.reward(1.0)
    assert flags(gw, "ok") == []


def test_calls_the_gateway_recorded_otherwise_are_not_flagged(gw: FakeGateway) -> None:
    # an ad-hoc rollout reopened to reward it: its calls were made outside any scope
    gw.state.spans["adhoc-1"] = [{"span_id": "s1"}]
    with tg.rollout(rollout_id="adhoc-1"):
        tg.reward(1.0)
    assert flags(gw, "adhoc-1") == []


def test_scope_end_is_checked_only_where_the_rollout_was_opened(gw: FakeGateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with tg.rollout(rollout_id="outer"):
        with tg.rollout(agent_name="planner"):
            httpx.get(gw.url + "/echo")  # reaches the gateway: a check here would flag
        client.chat.completions.create(model="fake", messages=MSGS)
    assert flags(gw, "outer") == []
    with tg.rollout(rollout_id="ended"):
        httpx.get(gw.url + "/echo")
    assert flags(gw, "ended")[0]["attributes"]["when"] == "scope_end"


def test_a_failed_scope_is_not_checked(gw: FakeGateway) -> None:
    with pytest.raises(RuntimeError), tg.rollout(rollout_id="failed"):
        httpx.get(gw.url + "/echo")
        raise RuntimeError("agent broke")
    assert flags(gw, "failed") == []


def test_a_scope_that_never_reached_the_gateway_is_warned_not_created(
    gw: FakeGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tracegym.attribution")
    with tg.rollout(rollout_id="silent"):
        pass
    assert "silent" not in gw.state.events and gw.state.attempts == []
    assert any("rollout silent" in r.getMessage() for r in caplog.records)


async def test_async_scope_and_areward_are_checked(gw: FakeGateway) -> None:
    async with httpx.AsyncClient() as client:
        async with tg.rollout(rollout_id="async-end"):
            await client.get(gw.url + "/echo")

        @tg.rollout(rollout_id="async-reward")
        async def agent() -> None:
            await tg.areward(0.5)

        await agent()
    assert flags(gw, "async-end")[0]["attributes"]["when"] == "scope_end"
    assert flags(gw, "async-reward")[0]["attributes"]["when"] == "reward"


def test_unreachable_gateway_never_fails_the_scope(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tracegym.attribution")
    tg.configure(gateway_url=f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with tg.rollout(rollout_id="unreachable") as scope:
        scope.tally.touch()  # as if a request had been tried: the check asks the gateway
    join_checks()
    assert time.monotonic() - start < 3.0
    assert any("could not check that rollout unreachable" in r.getMessage() for r in caplog.records)
    assert scope.tally.due()  # inconclusive: a later trigger may check again


@pytest.mark.parametrize("agent", [agents.echo_reward, agents.async_slow], ids=["sync", "async"])
async def test_runner_rollout_without_calls_is_flagged(gw: FakeGateway, agent: Any) -> None:
    with GatewayClient() as c:
        (task,) = c.enqueue_tasks([{"input": {"reward": 1.0, "sleep": 0}}])
    (rid,) = task["rollout_ids"]
    stats = await run_agent(agent, gw.url, exit_when_idle=True, poll_interval=0.05)
    assert stats.done == 1 and gw.state.rollouts[rid]["status"] == "completed"
    (flag,) = flags(gw, rid)
    assert flag["attributes"]["when"] == "scope_end"


_TWO_ROLLOUTS = """
import sys
import tracegym as tg
tg.configure(gateway_url=sys.argv[1], retry_attempts=2, retry_backoff=0.01)
for rid in ("first", "second"):
    with tg.rollout(rollout_id=rid):
        tg.reward(1.0)
print("done")
"""


def test_warned_once_per_process(gw: FakeGateway) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _TWO_ROLLOUTS, gw.url], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "no LLM call attributed" in line]
    assert len(warnings) == 1, out.stderr
    rid = re.search(r"rollout (first|second) was rewarded", warnings[0])
    assert rid is not None, warnings[0]  # the checks run at once: either may warn first
    for phrase in ("does not instrument", "base_url", "copy_context", f"{gw.url}/rollouts/{rid[1]}/v1"):
        assert phrase in warnings[0]
    assert len(flags(gw, "first")) == len(flags(gw, "second")) == 1


async def test_a_sync_block_in_a_coroutine_does_not_block_the_loop(gw: FakeGateway) -> None:
    with tg.rollout(rollout_id="in-loop"):  # as the runner enters its scopes around async agents
        await asyncio.to_thread(httpx.get, gw.url + "/echo")
    assert checking("in-loop")  # the check (a second, finding nothing) runs in its own thread
    assert flags(gw, "in-loop")[0]["attributes"]["when"] == "scope_end"
