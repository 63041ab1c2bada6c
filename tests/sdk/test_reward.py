"""Rewards and events: delivered at least once, counted once; clear errors when they cannot be."""

from __future__ import annotations

import time

import pytest

import tracegym as tg
from tests.procs import free_port
from tests.sdk.fake_gateway import FakeGateway


def test_reward_and_emit(gw: FakeGateway) -> None:
    with tg.rollout(rollout_id="r1"):
        tg.reward(0.5)
        tg.reward(1, name="format")
        tg.emit("tool_call", {"tool": "calc", "ok": True})
        tg.emit("turns", 3)
    events = list(gw.state.events["r1"].values())
    assert [(e["kind"], e.get("value"), e.get("name")) for e in events] == [
        ("reward", 0.5, None),
        ("reward", 1.0, "format"),
        ("event", None, "tool_call"),
        ("event", 3, "turns"),
    ]
    assert events[2]["attributes"] == {"tool": "calc", "ok": True}
    assert len({e["idempotency_key"] for e in events}) == 4


def test_reward_outside_rollout_is_a_clear_error(gw: FakeGateway) -> None:
    with pytest.raises(tg.NoRolloutError, match=r"no current rollout.*tg\.rollout"):
        tg.reward(1.0)
    with pytest.raises(tg.NoRolloutError, match="outside a rollout"):
        tg.emit("x", 1)
    assert gw.state.attempts == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), True, "1.0", None])
def test_bad_reward_values(gw: FakeGateway, bad: object) -> None:
    with tg.rollout(), pytest.raises((TypeError, ValueError)):
        tg.reward(bad)  # type: ignore[arg-type]
    assert gw.state.attempts == []


def test_retry_after_dropped_answers_counts_once(gw: FakeGateway) -> None:
    gw.state.fail_next, gw.state.store_then_fail = 2, True  # stored, but the first two answers are lost
    with tg.rollout(rollout_id="r2"):
        out = tg.reward(1.0)
    assert gw.state.attempts == ["r2"] * 3
    assert len(gw.state.rewards("r2")) == 1
    assert out["duplicate"] is True  # the gateway saw the same key again


def test_retry_after_refused_requests(gw: FakeGateway) -> None:
    gw.state.fail_next = 3  # refused before storing
    with tg.rollout(rollout_id="r3"):
        tg.reward(0.25)
    assert gw.state.attempts == ["r3"] * 4
    assert [e["value"] for e in gw.state.rewards("r3")] == [0.25]


def test_gateway_started_late(late_gw: FakeGateway) -> None:
    with tg.rollout(rollout_id="late"):
        tg.reward(2.0)
    assert [e["value"] for e in late_gw.state.rewards("late")] == [2.0]


def test_unreachable_gateway_raises_after_bounded_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    tg.configure(gateway_url=url, retry_attempts=4, retry_backoff=0.05, retry_max_backoff=0.1)
    start = time.monotonic()
    with tg.rollout(), pytest.raises(tg.GatewayUnreachableError) as err:
        tg.reward(1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0
    msg = str(err.value)
    assert url in msg and "4 attempts" in msg and "ConnectError" in msg and "TRACEGYM_GATEWAY" in msg


def test_client_errors_are_not_retried(gw: FakeGateway) -> None:
    with tg.rollout(rollout_id="r4"), pytest.raises(ValueError, match="non-empty name"):
        tg.emit("", 1)  # rejected before sending
    assert gw.state.attempts == []
    from tracegym.client import GatewayClient

    with GatewayClient() as client, pytest.raises(tg.GatewayError) as err:
        client.post("/api/rollouts/x/heartbeat", {"worker_id": "w"}, "heartbeat x")
    assert err.value.status == 404 and "unknown rollout x" in str(err.value)
    assert gw.state.heartbeats == ["x"]  # one try: a 4xx is final


async def test_areward_and_aemit(gw: FakeGateway) -> None:
    gw.state.fail_next = 1
    async with tg.rollout(rollout_id="ar"):
        await tg.areward(0.75, name="judge")
        await tg.aemit("done", None)
    kinds = [(e["kind"], e.get("value")) for e in gw.state.events["ar"].values()]
    assert kinds == [("reward", 0.75), ("event", None)]
