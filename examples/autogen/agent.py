"""An AutoGen AgentChat agent (AssistantAgent + OpenAIChatCompletionClient) with a calculator, trained by
tracegym (`recipe.yaml`).

    tracegym train examples/autogen/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`):

    tracegym enqueue examples/autogen/eval.jsonl --group-size 4
    tracegym run examples/autogen/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: a 3-digit number times a 1-digit one. The agent keeps its conversation between runs
(``solver.run(task=...)`` again): a reply ``CALC <a> <op> <b>`` is answered with ``RESULT <number>``
as the next task, and the agent answers from it. Its model context starts with one worked exchange. The
tool speaks text because SmolLM2-135M never writes a JSON function call (docs/agents.md); with a model
that does, ``AssistantAgent(..., tools=[calculator], max_tool_iterations=N)`` runs it instead. The reward
is 1.0 when the last reply's last number is the answer. The two tracegym lines are marked.
"""

from __future__ import annotations

import os
import re

from autogen_agentchat.agents import AssistantAgent
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import AssistantMessage, UserMessage
from autogen_ext.models.openai import OpenAIChatCompletionClient

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
MAX_TURNS = 3
# AutoGen needs model_info for a model name it does not know.
MODEL_INFO = {"vision": False, "function_calling": False, "json_output": False, "family": "unknown",
              "structured_output": False}
SYSTEM = ("You have a calculator. To use it, reply with one line: CALC <a> <op> <b>. "
          "You get RESULT <number> back; then reply with the number.")
CALL = re.compile(r"CALC\s+(-?\d+)\s*([-+*/x])\s*(-?\d+)")


def worked_exchange() -> list:
    """One worked exchange at the head of the agent's model context."""
    return [UserMessage(content="What is 236 * 7?", source="user"), AssistantMessage(content="CALC 236 * 7", source="solver"),
            UserMessage(content="RESULT 1652", source="user"), AssistantMessage(content="1652", source="solver")]


def calculator(a: int, op: str, b: int) -> str:
    """The tool: ``RESULT <number>`` for ``a op b``."""
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else float("nan")}[op]
    return f"RESULT {int(value) if value == int(value) else value}" if value == value else "RESULT undefined"


def score(text: str, answer: int) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def agent(task: dict, base_url: str) -> None:
    client = OpenAIChatCompletionClient(  # tracegym line 1: the rollout's base_url
        model=MODEL, base_url=base_url, api_key="unused", model_info=MODEL_INFO, max_tokens=MAX_TOKENS,
        temperature=1.0, max_retries=0,
    )
    solver = AssistantAgent("solver", model_client=client, system_message=SYSTEM,
                            model_context=UnboundedChatCompletionContext(initial_messages=worked_exchange()))
    reply, called, message = "", False, task["question"]
    try:
        for _ in range(MAX_TURNS):  # bounded: a model that never stops calling the tool still ends
            result = await solver.run(task=message)
            reply = result.messages[-1].to_text()
            call = CALL.search(reply)
            if call is None:
                break  # an answer
            called = True
            message = calculator(int(call.group(1)), call.group(2), int(call.group(3)))
    finally:
        await client.close()
    await tg.aemit("tool_call", float(called))  # what the agent did, averaged in each evaluation
    await tg.areward(0.0 if CALL.search(reply) else score(reply, task["answer"]))  # tracegym line 2: the reward
