"""A tool-using agent: plain OpenAI SDK, a text tool protocol, several LLM calls per rollout.

The task: tell the secret code of one box. The code is only in the environment's table (``task["codes"]``),
so the model must call the tool: a reply holding ``LOOKUP <colour>`` gets ``RESULT <colour> box: <code>``
back as the next user message, and the model answers from it. A first reply without a call gets a nudge
instead and one more try, so every rollout makes at least two LLM calls. The reward comes from the
environment at the end: 1.0 when the last reply holds the asked box's code, else 0.0.

Why a text protocol and not OpenAI function tools: SmolLM2-135M never writes the hermes ``<tool_call>``
format (0 of 96 samples), but with one example exchange in the prompt it writes ``LOOKUP <colour>`` in
about 1 of 10 replies: a behaviour GRPO can reinforce (docs/agents.md).

    tracegym train examples/tool_agent/recipe.yaml

Nothing here knows about training except the two ``tg.aemit`` lines, which report what the agent did
(tool-call and valid-call rates, averaged in each evaluation and printed in the run's summary).
"""

from __future__ import annotations

import functools
import os
import re

import httpx
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # `tracegym train` sets the served model name
MAX_CALLS = 3
MAX_TOKENS = 20
CALL = re.compile(r"LOOKUP\s+([A-Za-z]+)")
NUDGE = "You did not look it up. Reply with LOOKUP <colour> to get the code."
EXAMPLE = [  # one worked exchange, as a few-shot prefix of every conversation
    {"role": "user", "content": "What is the secret code of the red box?"},
    {"role": "assistant", "content": "LOOKUP red"},
    {"role": "user", "content": "RESULT red box: 5821"},
    {"role": "assistant", "content": "The code is 5821."},
]


def lookup(codes: dict[str, int], colour: str) -> str:
    """The tool: the environment's answer to ``LOOKUP <colour>``."""
    colour = colour.lower()
    return f"RESULT {colour} box: {codes[colour]}" if colour in codes else f"RESULT there is no {colour} box."


def reward(reply: str, answer: int) -> float:
    """1.0 when the reply states the code (as a whole number), else 0.0."""
    return 1.0 if str(answer) in re.findall(r"\d+", reply) else 0.0


@functools.cache
def http_client() -> httpx.AsyncClient:
    """One connection pool for all rollouts of this process."""
    return httpx.AsyncClient(timeout=300)


async def agent(task: dict, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client())
    messages = [*EXAMPLE, {"role": "user", "content": f"What is the secret code of the {task['colour']} box?"}]
    called = valid = False
    reply = ""
    for turn in range(MAX_CALLS):
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
        )
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        call = CALL.search(reply)
        if call:
            called = True
            valid = valid or call.group(1).lower() == task["colour"]
            messages.append({"role": "user", "content": lookup(task["codes"], call.group(1))})
        elif turn == 0:
            messages.append({"role": "user", "content": NUDGE})
        else:
            break  # an answer
    await tg.aemit("tool_call", float(called))  # what the agent did, for the run's summary
    await tg.aemit("valid_call", float(valid))
    return 0.0 if CALL.search(reply) else reward(reply, task["answer"])
