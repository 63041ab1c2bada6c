"""Two agent roles in one rollout, each trained as its own LoRA adapter (recipe.yaml: ``lora.adapters``).

The planner restates the question as one arithmetic expression; the executor answers it. The gateway
routes each call to its role's adapter by the ``X-Agent-Name`` header, the spans record which adapter
served it, and the trainer updates each adapter on its own role's tokens. No training code here.
"""

from __future__ import annotations

import os
import re

from openai import AsyncOpenAI


async def agent(task: dict, base_url: str) -> float:
    model = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")
    a, b = task["a"], task["b"]
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        plan = await client.chat.completions.create(
            model=model, max_tokens=24, temperature=1.0, extra_headers={"X-Agent-Name": "planner"},
            messages=[{"role": "user", "content": f"Write the sum asked for as an expression: what is {a} plus {b}?"}])
        reply = await client.chat.completions.create(
            model=model, max_tokens=24, temperature=1.0, extra_headers={"X-Agent-Name": "executor"},
            messages=[{"role": "user", "content": f"Compute: {plan.choices[0].message.content}"}])
    numbers = re.findall(r"-?\d+", reply.choices[0].message.content or "")
    return float(bool(numbers) and int(numbers[-1]) == a + b)
