"""A test agent for runs that must train every step: one model call, then a reward drawn from [0, 1), so
no two rollouts of a group tie and no group is dropped for lack of signal (what is learnt is beside the
point; the tests using it check the plumbing)."""

from __future__ import annotations

import os
import random

from openai import AsyncOpenAI


async def agent(task: dict, base_url: str) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(
            model=os.environ.get("TRACEGYM_MODEL", "tiny-random"),
            messages=[{"role": "user", "content": task["question"]}],
            max_tokens=8,
            temperature=1.0,
        )
    return random.random()
