"""The tools-API agent of `agent.py` on the Anthropic SDK: ``tools=[calculator]`` (``input_schema``) in a
Messages request, the model's calls read from the reply's ``tool_use`` blocks (the gateway parses the
model's native call syntax), results sent back as ``tool_result`` blocks in the next user message. The
gateway renders a Messages conversation as the equivalent chat one, so this agent's prompts are token for
token those of the OpenAI-form demonstrations in `demos.jsonl`: the same recipe teaches it, SFT on them
and then GRPO on this agent's reward (`recipe-anthropic.yaml`; docs/recipe.md, "SFT then GRPO: a tool
agent on the tools API").

    tracegym train examples/tool_agent_sft/recipe-anthropic.yaml

The task, the reward and the emitted numbers are `agent.py`'s: "What is A * B?" for two 2-digit numbers,
reward 1.0 when the last reply (one without a call) ends with the product; ``tool_call`` (the first reply
is a call), ``valid_call`` (a call of the calculator whose input evaluates) and ``right_call`` (the
expression asked for). The Anthropic client appends ``/v1/messages`` itself, so its base URL is the
rollout's without ``/v1``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import anthropic
from multiply_task import calculator, question, score

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # `tracegym train` sets the served model name
MAX_TURNS = 3
MAX_TOKENS = 40
TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    }
]


def run_call(name: str, tool_input: dict[str, Any]) -> tuple[str, bool]:
    """The ``tool_result`` text for one ``tool_use`` block and whether it was a valid calculator call."""
    if name != "calculator":
        return "error: no such tool", False
    expression = tool_input.get("expression")
    if not isinstance(expression, str):
        return 'error: give {"expression": "<a> <op> <b>"}', False
    result = calculator(expression)
    return result, not result.startswith("error")


@functools.cache
def http_client() -> anthropic.DefaultAsyncHttpxClient:
    """One connection pool for all rollouts of this process (the SDK's own client class)."""
    return anthropic.DefaultAsyncHttpxClient(timeout=900)


async def agent(task: dict, base_url: str) -> float:
    client = anthropic.AsyncAnthropic(
        base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, http_client=http_client()
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(task["a"], task["b"])}]
    first_call = valid = right = False
    text, calls = "", []
    for turn in range(MAX_TURNS):  # bounded: a model that never stops calling still ends
        # no temperature (this SDK's create() takes none): the gateway samples at 1.0, as agent.py asks
        reply = await client.messages.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
        )
        text = "".join(b.text for b in reply.content if b.type == "text")
        calls = [b for b in reply.content if b.type == "tool_use"]
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
        )
        if not calls:
            break  # an answer
        first_call = first_call or turn == 0
        results = []
        for c in calls:
            result, ok = run_call(c.name, c.input)
            valid = valid or ok
            right = right or (ok and result == str(task["answer"]))
            results.append(
                {"type": "tool_result", "tool_use_id": c.id, "content": result, "is_error": not ok}
            )
        messages.append({"role": "user", "content": results})
    await tg.aemit("tool_call", float(first_call))  # what the agent did, for the run's summary
    await tg.aemit("valid_call", float(valid))
    await tg.aemit("right_call", float(right))
    return 0.0 if calls else score(text, task["answer"])
