"""A two-role test agent for per-agent LoRA on tiny-random: a planner call, then an executor call that
sees the plan, both in one rollout (told apart by ``X-Agent-Name``); reward = 1 when the executor's
reply has an even number of characters (random text gives both outcomes, so groups carry signal)."""

from __future__ import annotations

import os

from openai import AsyncOpenAI


async def agent(task: dict, base_url: str) -> float:
    model = os.environ.get("TRACEGYM_MODEL", "tiny-random")
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        plan = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Plan: {task['question']}"}], max_tokens=6,
            temperature=1.0, extra_headers={"X-Agent-Name": "planner"})
        reply = await client.chat.completions.create(
            model=model, max_tokens=6, temperature=1.0, extra_headers={"X-Agent-Name": "executor"},
            messages=[{"role": "user", "content": f"Do it: {plan.choices[0].message.content}"}])
    return float(len(reply.choices[0].message.content or "") % 2 == 0)
