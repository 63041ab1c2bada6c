"""A tool agent on the OpenAI tools API: ``tools=[calculator]`` in the request, the model's calls read from
``message.tool_calls`` (the gateway parses the model's native call syntax), results sent back as ``tool``
messages. SmolLM2-135M never writes a tool call by itself, so the recipe first fine-tunes it on 32
imported demonstrations (`demos.jsonl`), then trains it with GRPO on this agent's reward
(docs/recipe.md, "SFT then GRPO: a tool agent on the tools API").

The task: "What is A * B?" for two 2-digit numbers, which the model cannot compute in its head. The reward
is 1.0 when the last reply (one without a call) ends with the product. The agent also reports what it did
(``tg.emit``): ``tool_call`` (the first reply is a call), ``valid_call`` (a call of the calculator whose
arguments evaluate) and ``right_call`` (the expression asked for).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import httpx
from multiply_task import calculator, question, score
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # `tracegym train` sets the served model name
MAX_TURNS = 3
MAX_TOKENS = 40
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def run_call(arguments: str) -> tuple[str, bool]:
    """The tool message's content for one call's ``arguments`` (a JSON string) and whether they were valid."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON", False
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return 'error: give {"expression": "<a> <op> <b>"}', False
    result = calculator(expression)
    return result, not result.startswith("error")


@functools.cache
def http_client() -> httpx.AsyncClient:
    """One connection pool for all rollouts of this process."""
    return httpx.AsyncClient(timeout=900)


async def agent(task: dict, base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client())
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(task["a"], task["b"])}]
    first_call = valid = right = False
    content, calls = "", []
    for turn in range(MAX_TURNS):  # bounded: a model that never stops calling still ends
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0
        )
        message = response.choices[0].message
        content, calls = message.content or "", message.tool_calls or []
        if not calls:
            messages.append({"role": "assistant", "content": content})
            break  # an answer
        first_call = first_call or turn == 0
        messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in calls
                ],
            }
        )
        for c in calls:
            result, ok = (
                run_call(c.function.arguments)
                if c.function.name == "calculator"
                else ("error: no such tool", False)
            )
            valid = valid or ok
            right = right or (ok and result == str(task["answer"]))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    await tg.aemit("tool_call", float(first_call))  # what the agent did, for the run's summary
    await tg.aemit("valid_call", float(valid))
    await tg.aemit("right_call", float(right))
    return 0.0 if calls else score(content, task["answer"])
