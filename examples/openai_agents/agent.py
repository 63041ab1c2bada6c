"""An OpenAI Agents SDK agent (``Agent`` + a ``function_tool``, run by ``Runner.run`` on the Responses API),
trained by tracegym.

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/openai_agents/tasks.jsonl --group-size 4
    tracegym run examples/openai_agents/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

`tracegym run` awaits agent(task, base_url) for each queued rollout. The two tracegym lines are marked.
Set TRACEGYM_OPENAI_API=chat to run the same agent on Chat Completions instead.
"""

import os
import re

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3
set_tracing_disabled(True)  # the SDK's own trace export goes to OpenAI's servers; tracegym records the calls


@function_tool
def calculator(a: float, op: str, b: float) -> str:
    """Compute `a op b` for op in + - * /."""
    ops = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}
    return str(ops[op]) if op in ops else f"error: unknown op {op!r}"


def score(text: object, answer: float) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", str(text or ""))
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def agent(task: dict, base_url: str) -> None:
    client = AsyncOpenAI(base_url=base_url, api_key="unused")  # tracegym line 1: the rollout's base_url
    api = OpenAIChatCompletionsModel if os.environ.get("TRACEGYM_OPENAI_API") == "chat" else OpenAIResponsesModel
    solver = Agent(
        name="solver",
        instructions="Use the calculator tool, then reply with just the number.",
        tools=[calculator],
        model=api(model=MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    try:
        result = await Runner.run(solver, task["question"], max_turns=MAX_TURNS)
        reply = result.final_output
    except MaxTurnsExceeded:  # a policy that never stops calling tools earns nothing
        reply = None
    finally:
        await client.close()
    await tg.areward(score(reply, task["answer"]))  # tracegym line 2: the reward
