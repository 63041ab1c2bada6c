"""Agent functions the runner tests run (imported by MODULE:FUNCTION and by file path)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

import tracegym as tg


def echo_reward(task: dict[str, Any], base_url: str) -> float:
    """Checks the scope and the base_url match, then returns the task's reward."""
    scope = tg.current_rollout()
    assert scope is not None and base_url.endswith(f"/rollouts/{scope.rollout_id}/v1")
    return float(task["reward"])


def raises(task: Any, base_url: str) -> None:
    raise ValueError(f"agent broke on {task!r}")


def bad_return(task: Any, base_url: str) -> str:
    return "not a reward"


def nan_reward(task: Any, base_url: str) -> float:
    return float("nan")  # a float the gateway cannot store


def reward_via_sdk(task: dict[str, Any], base_url: str) -> None:
    tg.reward(task["reward"])
    tg.emit("seen_headers", httpx.get(base_url.split("/rollouts/")[0] + "/echo").json().get("x-rollout-id"))


async def async_agent(task: dict[str, Any], base_url: str) -> float:
    await asyncio.sleep(task.get("sleep", 0))
    await tg.areward(task["reward"], name="async")
    return task["reward"]


def slow(task: dict[str, Any], base_url: str) -> float:
    time.sleep(task.get("sleep", 2.0))
    return 1.0


async def async_slow(task: dict[str, Any], base_url: str) -> float:
    await asyncio.sleep(task.get("sleep", 2.0))
    return 1.0


def rewards_and_events(task: dict[str, Any], base_url: str) -> None:
    """Sends a named component, an event and the final (unnamed) reward; returns nothing."""
    tg.reward(0.1, name="format")
    tg.emit("turns", {"n": 2})
    tg.reward(task["reward"])
