"""The quickstart agent: an ordinary OpenAI-SDK program that answers "What is A+B?".

Nothing here knows about training. `tracegym run agent:agent` (started by `tracegym train`) calls
`agent(task, base_url)` once per rollout; the float it returns is the rollout's reward.
"""

from __future__ import annotations

import functools
import os
import re

import httpx
from openai import AsyncOpenAI

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # `tracegym train` sets the served model name
NUMBER = re.compile(r"-?\d+")


def last_number_reward(text: str, answer: int) -> float:
    """1.0 when the last number in the reply is the answer, else 0.0."""
    numbers = NUMBER.findall(text or "")
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


@functools.cache
def http_client() -> httpx.AsyncClient:
    """One connection pool for all rollouts of this process: a new client per call would build a new
    SSL context each time (~70 ms of CPU, measured as most of the runner's time)."""
    return httpx.AsyncClient(timeout=300)


async def agent(task: dict, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client())
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=24,
        temperature=1.0,
    )
    return last_number_reward(reply.choices[0].message.content or "", task["answer"])
