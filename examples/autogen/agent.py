"""An AutoGen AgentChat agent (AssistantAgent + OpenAIChatCompletionClient + a tool), trained by tracegym.

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/autogen/tasks.jsonl --group-size 4
    tracegym run examples/autogen/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

`tracegym run` awaits agent(task, base_url) for each queued rollout. The two tracegym lines are marked.
"""

import os
import re

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3
# AutoGen needs model_info for a model name it does not know.
MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


def calculator(a: float, op: str, b: float) -> str:
    """Compute `a op b` for op in + - * /."""
    ops = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}
    return str(ops[op]) if op in ops else f"error: unknown op {op!r}"


def score(text: str, answer: float) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def agent(task: dict, base_url: str) -> None:
    client = OpenAIChatCompletionClient(  # tracegym line 1: the rollout's base_url
        model=MODEL, base_url=base_url, api_key="unused", model_info=MODEL_INFO, max_tokens=MAX_TOKENS
    )
    solver = AssistantAgent(
        "solver",
        model_client=client,
        tools=[calculator],
        max_tool_iterations=MAX_TURNS,
        system_message="Use the calculator tool, then reply with just the number.",
    )
    try:
        result = await solver.run(task=task["question"])
    finally:
        await client.close()
    await tg.areward(score(result.messages[-1].to_text(), task["answer"]))  # tracegym line 2: the reward
