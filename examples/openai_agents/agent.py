"""An OpenAI Agents SDK agent (``Agent`` run by ``Runner.run`` on the Responses API) with a calculator, trained
by tracegym (`recipe.yaml`).

    tracegym train examples/openai_agents/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/openai_agents/eval.jsonl --group-size 4
    tracegym run examples/openai_agents/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: the difference of two 4-digit numbers. The run's input starts with one worked exchange; a
reply ``CALC <a> <op> <b>`` gets ``RESULT <number>`` back: the next ``Runner.run`` continues
``result.to_input_list()`` with it as a user turn. The tool speaks text because SmolLM2-135M never writes
a function call (docs/agents.md); with a model that does, ``Agent(..., tools=[function_tool(...)])``
runs it inside one ``Runner.run``. The reward is 1.0 when the last reply's last number is the answer.
The two tracegym lines are marked. Set TRACEGYM_OPENAI_API=chat to run it on Chat Completions instead.
"""

from __future__ import annotations

import os
import re

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
INSTRUCTIONS = ("You have a calculator. To use it, reply with one line: CALC <a> <op> <b>. "
                "You get RESULT <number> back; then reply with the number.")
EXAMPLE = [  # one worked exchange at the head of every run's input
    {"role": "user", "content": "What is 7304 - 2859?"},
    {"role": "assistant", "content": "CALC 7304 - 2859"},
    {"role": "user", "content": "RESULT 4445"},
    {"role": "assistant", "content": "4445"},
]
CALL = re.compile(r"CALC\s+(-?\d+)\s*([-+*/x])\s*(-?\d+)")
set_tracing_disabled(True)  # the SDK's own trace export goes to OpenAI's servers; tracegym records the calls


def calculator(a: int, op: str, b: int) -> str:
    """The tool: ``RESULT <number>`` for ``a op b``."""
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else float("nan")}[op]
    return f"RESULT {int(value) if value == int(value) else value}" if value == value else "RESULT undefined"


def score(text: str, answer: int) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def agent(task: dict, base_url: str) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)  # tracegym line 1: the rollout's base_url
    api = OpenAIChatCompletionsModel if os.environ.get("TRACEGYM_OPENAI_API") == "chat" else OpenAIResponsesModel
    solver = Agent(name="solver", instructions=INSTRUCTIONS, model=api(model=MODEL, openai_client=client),
                   model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=1.0))
    conversation: list = [*EXAMPLE, {"role": "user", "content": task["question"]}]
    reply, called = "", False
    try:
        for _ in range(MAX_TURNS):  # bounded: a model that never stops calling the tool still ends
            result = await Runner.run(solver, conversation)
            reply = str(result.final_output or "")
            call = CALL.search(reply)
            if call is None:
                break  # an answer
            called = True
            conversation = [*result.to_input_list(),
                            {"role": "user", "content": calculator(int(call.group(1)), call.group(2), int(call.group(3)))}]
    finally:
        await client.close()
    await tg.aemit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    await tg.areward(0.0 if CALL.search(reply) else score(reply, task["answer"]))  # tracegym line 2: the reward
