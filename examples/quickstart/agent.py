"""The quickstart agent: an ordinary OpenAI-SDK program that answers "What is A+B?".

Nothing here knows about training. `tracegym run agent:agent` (started by `tracegym train`) calls
`agent(task, base_url)` once per rollout; the float it returns is the rollout's reward.
"""

from __future__ import annotations

import re

from openai import AsyncOpenAI

NUMBER = re.compile(r"-?\d+")


def last_number_reward(text: str, answer: int) -> float:
    """1.0 when the last number in the reply is the answer, else 0.0."""
    numbers = NUMBER.findall(text or "")
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


async def agent(task: dict, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    async with client:
        reply = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": task["question"]}],
            max_tokens=24,
            temperature=1.0,
        )
    return last_number_reward(reply.choices[0].message.content or "", task["answer"])
