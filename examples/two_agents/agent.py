"""Two agent roles in one rollout, each trained as its own LoRA adapter (recipe.yaml: ``lora.adapters``).

    tracegym train examples/two_agents/recipe.yaml

or, against a gateway you started (`tracegym serve --engine embedded --model smollm2-135m`; without
adapters loaded, both roles are served by the base model):

    tracegym enqueue examples/two_agents/eval.jsonl --group-size 4
    tracegym run examples/two_agents/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 16

The task: "What is A times B?" (or A plus B, A minus B), with numbers SmolLM2-135M cannot combine in
its head. The planner restates it as one calculator line, ``CALC <a> <op> <b>``; the agent runs the calculator; the
executor gets the question and the calculator's ``RESULT <number>`` (or, without a plan, the question
alone) and answers. Each role's prompt starts with one worked exchange of its own. The gateway routes
each call to its role's adapter by the ``X-Agent-Name`` header, the spans record which adapter served
it, and the trainer updates each adapter on its own role's tokens. The reward is 1.0 when the
executor's last number is the answer. The tracegym lines are marked; the rest is the agent.
"""

from __future__ import annotations

import os
import re

from openai import AsyncOpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "32"))
PLANNER = [
    {"role": "system", "content": "Restate the question as one calculator line: CALC <a> <op> <b>."},
    {"role": "user", "content": "What is 23 times 41?"},
    {"role": "assistant", "content": "CALC 23 * 41"},
]
EXECUTOR = [
    {"role": "system", "content": "Answer the question with the number. The calculator's result is given."},
    {"role": "user", "content": "What is 23 times 41?\nRESULT 943"},
    {"role": "assistant", "content": "943"},
]
CALL = re.compile(r"CALC\s+(-?\d+)\s*([-+*/x])\s*(-?\d+)")


def calculator(a: int, op: str, b: int) -> str:
    """The tool: ``RESULT <number>`` for ``a op b``."""
    value = {"+": a + b, "-": a - b, "*": a * b, "x": a * b, "/": a / b if b else float("nan")}[op]
    return f"RESULT {int(value) if value == int(value) else value}" if value == value else "RESULT undefined"


def score(text: str, answer: int) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


async def ask(client: AsyncOpenAI, role: str, messages: list[dict]) -> str:
    """One call of one role: the ``X-Agent-Name`` header picks the role's adapter."""
    response = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0,
        extra_headers={"X-Agent-Name": role})  # fmt: skip
    return response.choices[0].message.content or ""


async def agent(task: dict, base_url: str) -> None:
    question = task["question"]
    # tracegym line 1: the rollout's base_url
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        plan = CALL.search(await ask(client, "planner", [*PLANNER, {"role": "user", "content": question}]))
        result = calculator(int(plan.group(1)), plan.group(2), int(plan.group(3))) if plan else ""
        answer = await ask(
            client, "executor", [*EXECUTOR, {"role": "user", "content": f"{question}\n{result}".strip()}]
        )
    await tg.aemit("tool_call", float(plan is not None))  # what the planner did, averaged in each evaluation
    await tg.areward(score(answer, task["answer"]))  # tracegym line 2: the reward
