"""A plain OpenAI SDK agent with a calculator tool, trained by tracegym.

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/openai/tasks.jsonl --group-size 4
    tracegym run examples/openai/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

`tracegym run` calls agent(task, base_url) for each queued rollout. The two tracegym lines are marked.
"""

import json
import os
import re

from openai import OpenAI

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Compute `a op b` for op in + - * /.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "op": {"type": "string"}, "b": {"type": "number"}},
                "required": ["a", "op", "b"],
            },
        },
    }
]


def calculator(arguments: str) -> str:
    """Run the tool on the model's JSON arguments; any mistake becomes an error message for the model."""
    try:
        args = json.loads(arguments)
        a, op, b = float(args["a"]), args["op"], float(args["b"])
        return str({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[op])
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e!r}"


def score(text: str | None, answer: float) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


def agent(task: dict, base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused")  # tracegym line 1: the rollout's base_url
    messages = [
        {"role": "system", "content": "Use the calculator tool, then reply with just the number."},
        {"role": "user", "content": task["question"]},
    ]
    reply = None
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling tools still ends
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
        )
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    tg.reward(score(reply.content if reply else None, task["answer"]))  # tracegym line 2: the reward
