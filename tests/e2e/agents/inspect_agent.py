"""A test agent that gives the trace inspector something to show on tiny-random: three chat turns that
continue each other, and by task flags a rewritten earlier reply (the next prompt forks), a streamed call
the agent stops reading after its first chunk (recorded as an error and left out of training), or an
exception (the rollout fails, with its traceback stored). Reward: an even-length last reply."""

from __future__ import annotations

import os

from openai import AsyncOpenAI

MODEL = os.environ.get("TRACEGYM_MODEL", "tiny-random")


async def agent(task: dict, base_url: str) -> float:
    if task.get("fail"):
        raise RuntimeError(f"task {task['question']!r} fails on purpose")
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages: list[dict] = [{"role": "user", "content": task["question"]}]
        reply = None
        for turn in range(3):
            if turn == 2 and task.get("edit"):  # rewrite the first reply: this prompt cannot reuse the ids
                messages[1] = {"role": "assistant", "content": "An edited reply."}
            reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                         temperature=1.0)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"Turn {turn + 2}: go on."}]
        if task.get("cut"):
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400,
                                                          temperature=1.0, stream=True)
            async for _chunk in stream:
                break
            await stream.close()
    assert reply is not None
    return float(len(reply.choices[0].message.content or "") % 2 == 0)
