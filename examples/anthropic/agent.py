"""An Anthropic SDK agent (``anthropic.Anthropic`` Messages with a tool, multi-turn), trained by tracegym.

    tracegym serve --engine embedded --model smollm2-135m &
    tracegym enqueue examples/anthropic/tasks.jsonl --group-size 4
    tracegym run examples/anthropic/agent.py:agent --gateway http://127.0.0.1:8000 --concurrency 4

`tracegym run` calls agent(task, base_url) for each queued rollout. The two tracegym lines are marked.
The Anthropic client appends ``/v1/messages`` itself, so its base URL is the rollout's without ``/v1``.
"""

import os
import re

import anthropic

import tracegym as tg

MODEL = os.environ.get("TRACEGYM_MODEL", "smollm2-135m")  # the name the gateway serves
MAX_TOKENS = int(os.environ.get("TRACEGYM_MAX_TOKENS", "256"))
MAX_TURNS = 3
TOOLS = [
    {
        "name": "calculator",
        "description": "Compute `a op b` for op in + - * /.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "op": {"type": "string"}, "b": {"type": "number"}},
            "required": ["a", "op", "b"],
        },
    }
]


def calculator(args: dict) -> str:
    """Run the tool on the model's input; any mistake becomes an error message for the model."""
    try:
        a, op, b = float(args["a"]), args["op"], float(args["b"])
        return str({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[op])
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e!r}"


def score(text: str, answer: float) -> float:
    """1.0 if the last number in the reply is the answer, else 0.0 (handles any text)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return 1.0 if numbers and float(numbers[-1]) == answer else 0.0


def agent(task: dict, base_url: str) -> None:
    # tracegym line 1: the rollout's base_url, without /v1
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused")
    messages: list = [{"role": "user", "content": task["question"]}]
    text = ""
    for _ in range(MAX_TURNS):  # bounded: a model that never stops calling tools still ends
        reply = client.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, tools=TOOLS, messages=messages,
            system="Use the calculator tool, then reply with just the number.",
        )
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        text = "".join(b.text for b in reply.content if b.type == "text")
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": calculator(u.input)} for u in uses]})
    client.close()
    tg.reward(score(text, task["answer"]))  # tracegym line 2: the reward
