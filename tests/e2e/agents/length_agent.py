"""A test agent for the training loop on tiny-random: reward = 1 when the reply has an even number of
characters (random text gives both outcomes, so groups carry signal)."""

from __future__ import annotations

import os

from openai import AsyncOpenAI


async def agent(task: dict, base_url: str) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        model = os.environ.get("TRACEGYM_MODEL", "tiny-random")
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task["question"]}], max_tokens=8, temperature=1.0
        )
    return float(len(reply.choices[0].message.content or "") % 2 == 0)
