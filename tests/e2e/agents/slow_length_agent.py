"""``length_agent`` after a pause of ``TRACEGYM_TEST_AGENT_SLEEP`` seconds (default 1): a step's rollouts
finish one by one, so a test can stop the trainer while a group is part done."""

from __future__ import annotations

import asyncio
import os

from tests.e2e.agents.length_agent import agent as length_agent


async def agent(task: dict, base_url: str) -> float:
    await asyncio.sleep(float(os.environ.get("TRACEGYM_TEST_AGENT_SLEEP", "1")))
    return await length_agent(task, base_url)
